"""The dynamic batcher with a plain numpy function as the model: merging, splitting, errors, overflow, close."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from cloud.serving.tensor.batcher import DynamicBatcher
from shared.errors import ApplicationError, ConfigurationError, RateLimitError, ServiceUnavailableError, ValidationError

WEIGHTS = np.arange(12, dtype=np.float32).reshape(4, 3)


def model(x: np.ndarray) -> np.ndarray:
    return x @ WEIGHTS


class RecordingModel:
    """``model`` that remembers the rows of every batch it ran."""

    def __init__(self, fn: Callable[[np.ndarray], np.ndarray] = model) -> None:
        self.fn = fn
        self.batches: list[np.ndarray] = []

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.batches.append(x.copy())
        return self.fn(x)


class BlockingModel:
    """``model`` that holds its first batch until released, so tests can queue requests behind it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.started.set()
        if not self.release.wait(timeout=30):
            raise TimeoutError("the test never released the model")
        return model(x)

    async def wait_started(self) -> None:
        for _ in range(3000):
            if self.started.is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the model never started")


def request(i: int, num_rows: int = 1) -> np.ndarray:
    """Rows whose values identify the request (every element is ``i``)."""
    return np.full((num_rows, 4), i, dtype=np.float32)


def test_concurrent_requests_are_merged_and_each_gets_its_own_rows_back() -> None:
    recorder = RecordingModel()
    inputs = [request(i, num_rows=1 + i % 3) for i in range(40)]

    async def main() -> list[np.ndarray]:
        async with DynamicBatcher(recorder, max_batch_size=16, max_queue_delay_ms=20, max_queue_size=100) as b:
            results = await asyncio.gather(*(b.submit(x) for x in inputs))
            assert b.num_requests == 40
            assert b.num_batches == len(recorder.batches)
            assert b.num_batches < b.num_requests
            assert b.mean_batch_size > 1
        return results

    results = asyncio.run(main())
    for x, out in zip(inputs, results, strict=True):
        np.testing.assert_array_equal(out, model(x))
    assert all(len(batch) <= 16 for batch in recorder.batches)
    # Whole requests in arrival order: the batches, stacked, are the inputs stacked.
    np.testing.assert_array_equal(np.concatenate(recorder.batches), np.concatenate(inputs))


def test_a_request_larger_than_a_batch_is_split_and_reassembled() -> None:
    recorder = RecordingModel()
    big = np.arange(40, dtype=np.float32).reshape(10, 4)

    async def main() -> tuple[np.ndarray, np.ndarray]:
        async with DynamicBatcher(recorder, max_batch_size=4, max_queue_delay_ms=5, max_queue_size=10) as b:
            return await asyncio.gather(b.submit(big), b.submit(request(7)))

    out_big, out_small = asyncio.run(main())
    np.testing.assert_array_equal(out_big, model(big))
    np.testing.assert_array_equal(out_small, model(request(7)))
    # Chunks of 4, 4 and 2 rows; the 2-row tail shares its batch with the next request.
    assert [len(batch) for batch in recorder.batches] == [4, 4, 3]


def test_a_lone_request_waits_for_company_about_max_queue_delay_and_a_full_batch_does_not_wait() -> None:
    async def main() -> tuple[float, float]:
        async with DynamicBatcher(model, max_batch_size=8, max_queue_delay_ms=100, max_queue_size=10) as b:
            start = time.monotonic()
            await b.submit(request(1))
            lone = time.monotonic() - start
        async with DynamicBatcher(model, max_batch_size=8, max_queue_delay_ms=60_000, max_queue_size=10) as b:
            start = time.monotonic()
            await b.submit(request(2, num_rows=8))
            full = time.monotonic() - start
        return lone, full

    lone, full = asyncio.run(main())
    assert 0.08 <= lone < 10
    assert full < 10  # far below the one-minute delay


def test_a_failing_batch_fails_only_its_own_requests() -> None:
    def fragile(x: np.ndarray) -> np.ndarray:
        if (x == 5).any():
            raise ValueError("the model cannot take request 5")
        return model(x)

    recorder = RecordingModel(fragile)

    async def main() -> tuple[list[np.ndarray | BaseException], np.ndarray]:
        async with DynamicBatcher(recorder, max_batch_size=4, max_queue_delay_ms=20, max_queue_size=100) as b:
            results = await asyncio.gather(*(b.submit(request(i)) for i in range(12)), return_exceptions=True)
            after = await b.submit(request(20))  # the batcher keeps serving
            assert b.num_failed_batches == 1
        return results, after

    results, after = asyncio.run(main())
    poisoned = next(batch for batch in recorder.batches if (batch == 5).any())
    in_failed_batch = {int(v) for v in poisoned[:, 0]}
    for i, result in enumerate(results):
        if i in in_failed_batch:
            assert isinstance(result, ValueError)
            assert "request 5" in str(result)
        else:
            assert isinstance(result, np.ndarray)
            np.testing.assert_array_equal(result, model(request(i)))
    assert len(in_failed_batch) < len(results)
    np.testing.assert_array_equal(after, model(request(20)))


def test_a_model_that_returns_the_wrong_number_of_rows_fails_that_batch_clearly() -> None:
    async def main() -> None:
        async with DynamicBatcher(lambda x: x[:1], 8, 20, 10) as b:
            results = await asyncio.gather(b.submit(request(1)), b.submit(request(2)), return_exceptions=True)
        for result in results:
            assert isinstance(result, ApplicationError)
            assert "for a batch of 2 rows" in result.message

    asyncio.run(main())


def test_rows_of_different_shapes_run_in_separate_batches() -> None:
    recorder = RecordingModel(lambda x: x.sum(axis=1, keepdims=True))

    async def main() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        async with DynamicBatcher(recorder, max_batch_size=16, max_queue_delay_ms=20, max_queue_size=10) as b:
            return await asyncio.gather(b.submit(np.ones((2, 3))), b.submit(np.ones((1, 5))), b.submit(np.ones((1, 3))))

    narrow, wide, narrow_again = asyncio.run(main())
    np.testing.assert_array_equal(narrow, [[3.0], [3.0]])
    np.testing.assert_array_equal(wide, [[5.0]])
    np.testing.assert_array_equal(narrow_again, [[3.0]])
    assert [batch.shape for batch in recorder.batches] == [(2, 3), (1, 5), (1, 3)]


def test_a_full_queue_rejects_with_rate_limit_error() -> None:
    blocking = BlockingModel()

    async def main() -> None:
        b = DynamicBatcher(blocking, max_batch_size=1, max_queue_delay_ms=0, max_queue_size=2)
        await b.start()
        try:
            running = asyncio.create_task(b.submit(request(0)))
            await blocking.wait_started()
            queued = [asyncio.create_task(b.submit(request(i))) for i in (1, 2)]
            await asyncio.sleep(0)
            assert b.num_queued == 2
            with pytest.raises(RateLimitError) as excinfo:
                await b.submit(request(3))
            assert excinfo.value.status_code == 429
            assert excinfo.value.retry_after > 0
            assert b.num_rejected == 1
        finally:
            blocking.release.set()
        results = await asyncio.gather(running, *queued)
        for i, out in enumerate(results):
            np.testing.assert_array_equal(out, model(request(i)))
        await b.close()

    asyncio.run(main())


def test_close_drains_queued_requests_then_refuses_new_ones() -> None:
    async def main() -> None:
        b = DynamicBatcher(model, max_batch_size=4, max_queue_delay_ms=60_000, max_queue_size=100)
        await b.start()
        pending = [asyncio.create_task(b.submit(request(i))) for i in range(6)]
        await asyncio.sleep(0)
        await b.close()  # does not wait out the one-minute delay
        for i, task in enumerate(pending):
            assert task.done()
            np.testing.assert_array_equal(task.result(), model(request(i)))
        with pytest.raises(ServiceUnavailableError):
            await b.submit(request(9))
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def test_close_without_draining_fails_queued_requests_and_finishes_the_running_batch() -> None:
    blocking = BlockingModel()

    async def main() -> None:
        b = DynamicBatcher(blocking, max_batch_size=1, max_queue_delay_ms=0, max_queue_size=10)
        await b.start()
        running = asyncio.create_task(b.submit(request(0)))
        try:
            await blocking.wait_started()
            queued = [asyncio.create_task(b.submit(request(i))) for i in (1, 2, 3)]
            await asyncio.sleep(0)
            closing = asyncio.create_task(b.close(drain=False))
            await asyncio.sleep(0)
        finally:
            blocking.release.set()
        await closing
        np.testing.assert_array_equal(await running, model(request(0)))
        for task in queued:
            with pytest.raises(ServiceUnavailableError):
                await task
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def test_a_cancelled_request_is_skipped() -> None:
    recorder = RecordingModel()

    async def main() -> np.ndarray:
        async with DynamicBatcher(recorder, max_batch_size=8, max_queue_delay_ms=50, max_queue_size=10) as b:
            gone = asyncio.create_task(b.submit(request(1)))
            kept = asyncio.create_task(b.submit(request(2)))
            await asyncio.sleep(0)
            gone.cancel()
            return await kept

    np.testing.assert_array_equal(asyncio.run(main()), model(request(2)))
    assert [batch[:, 0].tolist() for batch in recorder.batches] == [[2.0]]


def test_bad_requests_fail_alone_before_queueing() -> None:
    def validate(x: np.ndarray) -> None:
        if x.shape[1:] != (4,):
            raise ValidationError(f"input 'x' expects 4 features per row, got shape {list(x.shape)}", param="x")

    async def main() -> None:
        with pytest.raises(ServiceUnavailableError):
            await DynamicBatcher(model, 4, 1, 10).submit(request(1))  # never started
        async with DynamicBatcher(model, 4, 1, 10, validate=validate) as b:
            with pytest.raises(ValidationError, match="one or more rows"):
                await b.submit(np.zeros((0, 4), np.float32))
            with pytest.raises(ValidationError, match="'x' expects 4 features"):
                await b.submit(np.zeros((1, 5), np.float32))
            np.testing.assert_array_equal(await b.submit(request(3)), model(request(3)))
            assert b.num_requests == 1

    asyncio.run(main())


@pytest.mark.parametrize(("size", "delay", "queue"), [(0, 1.0, 1), (1, -1.0, 1), (1, 1.0, 0), (1, float("nan"), 1)])
def test_limits_are_checked(size: int, delay: float, queue: int) -> None:
    with pytest.raises(ConfigurationError):
        DynamicBatcher(model, size, delay, queue)
