// tierline console: the little the pages do in the browser. No inline script anywhere (CSP script-src 'self').
"use strict";

function copySecret(button) {
  const input = document.getElementById(button.dataset.copy);
  if (!input) return;
  const done = () => {
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = "Copy"; }, 2000);
  };
  input.select();
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(input.value).then(done, () => { document.execCommand("copy"); done(); });
  } else {
    document.execCommand("copy");
    done();
  }
}

document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-copy]");
  if (button) copySecret(button);
});

document.addEventListener("change", (event) => {
  const select = event.target.closest("select[data-autosubmit]");
  if (select && select.form) select.form.requestSubmit();
});
