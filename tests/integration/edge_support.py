"""What edge tests share: the zoo's pairs of edge and cloud models, for an agent whose cloud does not send them."""

from __future__ import annotations

import json

from shared.edge_protocol import ModelPairing

# The zoo's edge models and the cloud models they escalate to, as TIERLINE_EDGE_CLOUD_PAIRS (device-local pairings).
ZOO_PAIRS = {
    "tierline/lm-edge": "tierline/lm-cloud",
    "tierline/digits-small": "tierline/digits-large",
    "tierline/digits-micro": "tierline/digits-large",
}
ZOO_PAIRS_ENV = {"TIERLINE_EDGE_CLOUD_PAIRS": json.dumps(ZOO_PAIRS)}
# The same as the pairings a ``Tiering`` takes directly.
ZOO_PAIRINGS = {edge: ModelPairing(model=edge, cloud_model=cloud) for edge, cloud in ZOO_PAIRS.items()}
