// The settings column: the API key (session storage: it leaves with the tab), and the sampling fields and
// priority (local storage: they are no secret, and a returning user wants them back).

import { $ } from "./dom.js";

const API_KEY = "tokend.playground.api-key";
const SETTINGS = "tokend.playground.settings";
const REMEMBERED = ["model", "priority", "temperature", "top-p", "max-tokens", "seed"];

/** Puts back what was saved, and saves each field as it changes. */
export function restoreSettings() {
  $("api-key").value = sessionStorage.getItem(API_KEY) ?? "";
  $("api-key").addEventListener("input", () => sessionStorage.setItem(API_KEY, $("api-key").value.trim()));
  const saved = readJSON(localStorage.getItem(SETTINGS));
  for (const id of REMEMBERED) {
    if (typeof saved[id] === "string" && id !== "model") $(id).value = saved[id];
    $(id).addEventListener("change", saveSettings);
  }
}

/** The model the user chose last time, to select again once the list of models arrives. */
export function savedModel() {
  return readJSON(localStorage.getItem(SETTINGS)).model ?? "";
}

function saveSettings() {
  const values = Object.fromEntries(REMEMBERED.map((id) => [id, $(id).value]));
  try {
    localStorage.setItem(SETTINGS, JSON.stringify(values));
  } catch {
    // storage full or refused (a private window): the settings still apply to this page
  }
}

/** The Authorization header for every call to the gateway, when a key was entered. */
export function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** The request fields the settings give; an empty field is left out, so that the server's default applies. */
export function requestFields() {
  const fields = { model: $("model").value };
  const numbers = { temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", seed: "seed" };
  for (const [name, id] of Object.entries(numbers)) {
    const text = $(id).value.trim();
    if (text !== "") fields[name] = Number(text);
  }
  if ($("priority").value) fields.priority = $("priority").value;
  return fields;
}

function readJSON(text) {
  try {
    const value = JSON.parse(text ?? "{}");
    return value && typeof value === "object" ? value : {};
  } catch {
    return {};
  }
}
