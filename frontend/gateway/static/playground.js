// The playground: a multi-turn chat against this gateway's /v1/chat/completions, streamed, with each answer's
// figures, and the server's load beside it. Plain modules, no build step, nothing from another origin.

import { AnswerClock } from "./answer_stats.js";
import { ApiError, apiError, streamChat } from "./chat_stream.js";
import { Conversation } from "./conversation.js";
import { renderConversation, updateTurn } from "./conversation_view.js";
import { $, copyText, element } from "./dom.js";
import { startLoadPanel } from "./load_panel.js";
import { authHeaders, requestFields, restoreSettings, savedModel } from "./settings.js";

const conversation = Conversation.restore();
let controller = null; // the streaming answer's: Stop aborts it, which closes the connection and the generation

async function loadModels() {
  let reply;
  try {
    reply = await fetch("/v1/models", { headers: authHeaders() });
  } catch {
    $("error").textContent = "cannot list models: the gateway does not answer";
    return;
  }
  if (!reply.ok) {
    const hint = reply.status === 401 ? " Enter an API key under Settings." : "";
    $("error").textContent = `cannot list models: ${(await apiError(reply)).describe()}.${hint}`;
    return;
  }
  $("error").textContent = "";
  const models = (await reply.json()).data ?? [];
  const wanted = $("model").value || savedModel();
  $("model").replaceChildren(...models.map((m) => element("option", { value: m.id, textContent: m.id })));
  if (models.some((m) => m.id === wanted)) $("model").value = wanted;
}

async function send() {
  if (controller) return;
  conversation.dropFailedTail();
  const text = $("prompt").value;
  if (text.trim()) {
    conversation.turns.push({ role: "user", content: text });
    $("prompt").value = "";
  } else if (!conversation.awaitsAnswer()) {
    $("prompt").focus();
    return; // nothing to send
  }
  const { model, ...settings } = requestFields();
  const body = {
    model,
    messages: conversation.messages(),
    ...settings,
    stream: true,
    stream_options: { include_usage: true },
  };
  $("request-json").textContent = JSON.stringify(body, null, 2);

  conversation.save(); // before the answer: a reload while it streams finds the question, ready to send again
  const answer = { role: "assistant", content: "", figures: null };
  conversation.turns.push(answer);
  const view = renderConversation(conversation);
  const clock = new AnswerClock();
  let usage = null;
  let finish = null;
  answer.figures = clock.figures(null, "waiting");
  updateTurn(view, answer, true);
  controller = new AbortController();
  setBusy(true);
  load.setStreaming(true);
  try {
    for await (const chunk of streamChat(body, authHeaders(), controller.signal)) {
      usage = chunk.usage ?? usage;
      for (const choice of chunk.choices ?? []) {
        if (choice.delta?.content) {
          clock.sawText();
          answer.content += choice.delta.content;
        }
        finish = choice.finish_reason ?? finish;
      }
      answer.figures = clock.figures(usage, "streaming");
      updateTurn(view, answer, true);
    }
    answer.figures = clock.figures(usage, finish ?? "incomplete");
  } catch (error) {
    if (error.name === "AbortError") {
      answer.figures = clock.figures(usage, "stopped");
      if (!answer.content) answer.error = "stopped before the first token";
    } else {
      answer.figures = clock.figures(usage, "failed");
      answer.error = error instanceof ApiError ? error.describe() : `the request failed: ${error.message}`;
    }
  } finally {
    controller = null;
    conversation.save();
    updateTurn(view, answer, false);
    setBusy(false);
    load.setStreaming(false);
  }
}

function editLast() {
  const text = conversation.takeBackLastUserTurn();
  if (text === null) return;
  conversation.save();
  renderConversation(conversation);
  $("prompt").value = text;
  $("prompt").focus();
}

function clear() {
  conversation.clear();
  renderConversation(conversation);
}

function setBusy(busy) {
  for (const id of ["send", "edit-last", "clear"]) $(id).disabled = busy;
  $("stop").disabled = !busy;
}

restoreSettings();
$("system").value = conversation.system;
$("system").addEventListener("input", () => {
  conversation.system = $("system").value;
  conversation.save();
});
renderConversation(conversation);
setBusy(false);

$("send").addEventListener("click", send);
$("stop").addEventListener("click", () => controller?.abort());
$("edit-last").addEventListener("click", editLast);
$("clear").addEventListener("click", clear);
$("copy-request").addEventListener("click", () => copyText($("request-json").textContent));
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});

const load = startLoadPanel(authHeaders);
$("api-key").addEventListener("change", () => {
  loadModels();
  load.refresh();
});
loadModels();
