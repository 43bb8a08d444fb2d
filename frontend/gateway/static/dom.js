// Small DOM helpers. Every string the page shows (model output, API errors, model names) goes in as text, never
// as markup: the page's CSP (trusted types) would refuse markup built from strings anyway.

export const $ = (id) => document.getElementById(id);

/** A new element with these properties (className, textContent, title, ...) and children. */
export function element(tag, properties = {}, ...children) {
  const node = Object.assign(document.createElement(tag), properties);
  node.append(...children);
  return node;
}

/** Copies text; the clipboard API needs a secure context (https or localhost), so elsewhere a selection does it. */
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = element("textarea", { value: text, readOnly: true, className: "offscreen" });
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

/** A button that copies what text() returns, and says so for a moment. */
export function copyButton(text, label = "Copy") {
  const button = element("button", { type: "button", className: "secondary small", textContent: label });
  button.addEventListener("click", async () => {
    try {
      await copyText(text());
      button.textContent = "Copied";
    } catch {
      button.textContent = "Copy failed";
    }
    setTimeout(() => {
      button.textContent = label;
    }, 1500);
  });
  return button;
}
