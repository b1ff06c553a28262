// The service's page: chat (streamed from /v1/chat/completions) and decisions (/v1/systemone).
// Everything the model or the API says is inserted with textContent, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
// the API lives beside the page, whatever prefix the application is served under
const BASE = location.pathname.endsWith("/") ? location.pathname : location.pathname + "/";
const KEY_STORE = "startlux-api-key";

let apiKey = sessionStorage.getItem(KEY_STORE) || "";
let onKey = null;                       // what to retry once a key is given

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---- errors and keys
function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

class APIError extends Error {
  constructor(message, status) { super(message); this.status = status; }
}

// An error response as one readable sentence: status, the API's message, the field it names, when to retry.
async function errorOf(response) {
  let body = null;
  try { body = await response.json(); } catch (e) { /* not JSON: the status says enough */ }
  const err = body && body.error ? body.error : {};
  let text = `${response.status}: ${err.message || response.statusText || "request failed"}`;
  if (err.param) text += ` (field: ${err.param})`;
  const retry = response.headers.get("Retry-After");
  if (retry && (response.status === 429 || response.status === 503)) text += ` Retry in ${retry} s.`;
  return new APIError(text, response.status);
}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers);
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(BASE + path, Object.assign({}, options, {headers}));
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new APIError("The service cannot be reached; check that it is running.", 0);
  }
  if (!response.ok) {
    const error = await errorOf(response);
    if (response.status === 401) askForKey();
    throw error;
  }
  return response;
}

function askForKey(retry) {
  if (retry) onKey = retry;
  $("key-panel").hidden = false;
  $("key-input").focus();
}

$("key-panel").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = $("key-input").value.trim();
  if ($("key-remember").checked) sessionStorage.setItem(KEY_STORE, apiKey);
  else sessionStorage.removeItem(KEY_STORE);
  $("key-input").value = "";
  $("key-panel").hidden = true;
  showError("");
  const retry = onKey;
  onKey = null;
  if (retry) retry();
});

// ---- tabs
for (const tab of document.querySelectorAll("[role=tab]")) {
  tab.addEventListener("click", () => {
    for (const other of document.querySelectorAll("[role=tab]")) {
      const selected = other === tab;
      other.setAttribute("aria-selected", String(selected));
      $(other.getAttribute("aria-controls")).hidden = !selected;
    }
    showError("");
  });
}

// ---- models: one choice per kind, from /v1/models (aliases left out: they name the same models)
async function loadModels() {
  try {
    const list = await (await api("v1/models")).json();
    for (const kind of ["chat", "decision"]) {
      const select = $(`${kind}-model`);
      select.replaceChildren(...list.data.filter((m) => m.kind === kind && !m.alias_of)
        .map((m) => { const o = el("option", "", m.id); o.value = m.id; return o; }));
      select.disabled = select.options.length < 2;
    }
  } catch (e) {
    if (e.status === 401) askForKey(loadModels);
    showError(e.message);
  }
}

// ---- chat
const conversation = [];     // {role, content, parts?} as the API takes them back
let controller = null;       // the running request's AbortController

// Server-sent events from a fetch response: yields each event's data.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

// An assistant reply's parts: text runs, and calculator calls with their results.
function renderParts(node, parts) {
  node.replaceChildren();
  for (let i = 0; i < parts.length; i++) {
    const part = parts[i];
    if (part.type === "text") {
      node.append(el("span", "text", part.text));
    } else if (part.type === "python") {
      const block = el("div", "calc");
      block.append(el("span", "calc-label", "calculator"), el("code", "calc-expr", part.text));
      const next = parts[i + 1];
      if (next && next.type === "python_output") {
        block.append(el("span", "calc-eq", "="), el("code", "calc-result", next.text));
        i++;
      }
      node.append(block);
    } else {                  // a result without its call
      const block = el("div", "calc");
      block.append(el("span", "calc-label", "result"), el("code", "calc-result", part.text));
      node.append(block);
    }
  }
}

function renderConversation() {
  const box = $("messages");
  box.replaceChildren();
  conversation.forEach((message, index) => {
    const item = el("div", `msg ${message.role}`);
    const body = el("div", "body");
    if (message.role === "assistant") renderParts(body, message.parts || [{type: "text", text: message.content}]);
    else body.textContent = message.content;
    item.append(body);
    if (message.note) item.append(el("div", "note", message.note));
    if (message.role === "user") {
      const edit = el("button", "link", "Edit");
      edit.type = "button";
      edit.addEventListener("click", () => editMessage(index));
      item.append(edit);
    }
    message.node = body;
    box.append(item);
  });
  box.scrollTop = box.scrollHeight;
  const busy = controller !== null;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !conversation.length;      // also resends a turn whose reply failed
}

function editMessage(index) {
  if (controller) return;
  $("chat-input").value = conversation[index].content;
  conversation.splice(index);           // that message and everything after it go; sending resends it
  renderConversation();
  $("chat-input").focus();
}

function numberSetting(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function history() {
  return conversation.map((m) => {
    const message = {role: m.role, content: m.content};
    if (m.parts && m.parts.some((p) => p.type !== "text")) message.parts = m.parts;
    return message;
  });
}

async function complete() {
  const reply = {role: "assistant", content: "", parts: []};
  const body = {messages: history(), stream: true, temperature: numberSetting("temperature"),
                top_k: numberSetting("top-k"), max_tokens: numberSetting("max-tokens"), seed: numberSetting("seed")};
  if ($("chat-model").value) body.model = $("chat-model").value;
  conversation.push(reply);
  controller = new AbortController();
  renderConversation();
  showError("");
  let finished = false;
  try {
    const response = await api("v1/chat/completions", {method: "POST", body: JSON.stringify(body),
                                                      signal: controller.signal});
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new APIError(`The reply was interrupted: ${chunk.error.message}`, 500);
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.content) {
        reply.content += delta.content;
        const last = reply.parts[reply.parts.length - 1];
        if (last && last.type === "text") last.text += delta.content;
        else reply.parts.push({type: "text", text: delta.content});
      }
      for (const part of delta.parts || []) reply.parts.push({type: part.type, text: part.text});
      if (choice.finish_reason) {
        finished = true;
        if (choice.finish_reason === "length") reply.note = "stopped at max tokens";
      }
      renderParts(reply.node, reply.parts);
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    if (!finished) throw new APIError("The reply ended before it was complete; regenerate to try again.", 500);
  } catch (e) {
    if (e.name === "AbortError") {
      reply.note = "stopped";
    } else {
      reply.note = "failed";
      if (e.status === 401) askForKey();
      showError(e.message);
      if (!reply.content && !reply.parts.length) conversation.pop();   // nothing came: keep the question only
    }
  } finally {
    controller = null;
    renderConversation();
  }
}

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("chat-input").value;
  if (!text.trim() || controller) return;
  conversation.push({role: "user", content: text});
  $("chat-input").value = "";
  complete();
});

$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});

$("stop").addEventListener("click", () => { if (controller) controller.abort(); });

$("regenerate").addEventListener("click", () => {
  if (controller) return;
  while (conversation.length && conversation[conversation.length - 1].role === "assistant") conversation.pop();
  if (conversation.length) complete();
});

$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation.length = 0;
  showError("");
  renderConversation();
});

// ---- decisions
const EXAMPLES = {
  "Fruit, a comparison, a count": {
    state: "The office opens at nine.",
    questions: {
      fruit: {type: "choice", instructions: "Which option is a fruit?", criteria: {a: "tiger", b: "plum", c: "drill"}},
      bigger: {type: "noul", instructions: "Is 71 greater than 18?"},
      count: {type: "score", instructions: "How many of these are a fruit: pear, bus, plum, hammer?",
              criteria: ["none", "one", "two", "three"]},
    },
  },
  "The largest number": {
    state: "Lunch is served at noon. Nobody answered the phone.",
    questions: {
      largest: {type: "choice", instructions: "Which number is the largest?", criteria: {n0: "42", n1: "17", n2: "88"}},
      less: {type: "noul", instructions: "Is 12 less than 40?"},
    },
  },
  "A JSON state": {
    state: {room: 4, note: "Lunch is served at noon."},
    questions: {
      vehicle: {type: "choice", instructions: "Which option is a vehicle?",
               criteria: {o0: "hammer", o1: "zebra", o2: "train", o3: "lemon"}},
      tools: {type: "score", instructions: "How many of these are a tool: saw, cat, drill?",
              criteria: ["none", "one", "two", "three"]},
    },
  },
};

for (const name of Object.keys(EXAMPLES)) $("examples").append(el("option", "", name));

// A JSON value typed in a text box, or an error message.
function parseJSON(text) {
  try { return {value: JSON.parse(text)}; } catch (e) { return {error: e.message}; }
}

function checkState() {
  const status = $("state-status");
  if ($("state-kind").value === "text") {
    status.textContent = "";
    return {value: $("state").value};
  }
  const parsed = parseJSON($("state").value);
  status.textContent = parsed.error ? `not JSON: ${parsed.error}` : "valid JSON";
  status.className = parsed.error ? "bad" : "good";
  return parsed;
}

$("state").addEventListener("input", checkState);
$("state-kind").addEventListener("change", checkState);

let questionCount = 0;

// A value from a request as a text box or a label shows it: text as it is, anything else as JSON.
function asText(value) {
  return value == null ? "" : (typeof value === "string" ? value : JSON.stringify(value));
}

function input(cls, label, value, placeholder) {
  const box = el("input", cls);
  box.value = value;
  box.setAttribute("aria-label", label);
  if (placeholder) box.placeholder = placeholder;
  return box;
}

// One criterion of a question (an option or a level): its fields and a button that removes it.
function criterion(list, kind, ...fields) {
  const line = el("div", `crit ${kind}`);
  const remove = el("button", "link", "remove");
  remove.type = "button";
  remove.addEventListener("click", () => line.remove());
  line.append(...fields, remove);
  list.append(line);
}

function addOption(list, id, description) {
  criterion(list, "option", input("opt-id", "option id", id),
            input("opt-text", "option description", asText(description), "description"));
}

function addLevel(list, level) {
  criterion(list, "level", el("span", "level-n", String(list.children.length)),
            input("level-text", "level", asText(level), "level"));
}

function addQuestion(type, name, question = {}) {
  const card = el("div", "card question");
  card.dataset.type = type;
  const head = el("div", "row");
  const nameInput = el("input", "q-name");
  nameInput.value = name || `${type}${++questionCount}`;
  nameInput.setAttribute("aria-label", "question name");
  const remove = el("button", "link", "remove question");
  remove.type = "button";
  remove.addEventListener("click", () => card.remove());
  head.append(el("strong", "", type), nameInput, remove);
  const instructions = el("textarea", "q-instructions");
  instructions.rows = 2;
  instructions.placeholder = "instructions (text, or JSON with the box ticked)";
  const given = question.instructions;
  instructions.value = asText(given);
  const asJSON = el("label", "inline");
  const box = el("input", "q-json");
  box.type = "checkbox";
  box.checked = given != null && typeof given !== "string";
  asJSON.append(box, " instructions are JSON");
  card.append(head, instructions, asJSON);
  const list = el("div", "crit-list");
  const criteria = question.criteria;
  if (type === "choice") {
    for (const [id, text] of Object.entries(criteria || {a: "", b: ""})) addOption(list, id, text);
    const more = el("button", "link", "+ option");
    more.type = "button";
    more.addEventListener("click", () => addOption(list, String.fromCharCode(97 + list.children.length), ""));
    card.append(list, more);
  } else if (type === "noul") {
    for (const side of ["true", "false"]) {
      const line = el("label", "crit");
      const input = el("input", `noul-${side}`);
      input.placeholder = "optional";
      input.value = (criteria && criteria[side]) || "";
      line.append(`${side === "true" ? "Yes" : "No"}: `, input);
      list.append(line);
    }
    card.append(list);
  } else {
    for (const level of criteria || ["low", "medium", "high"]) addLevel(list, level);
    const more = el("button", "link", "+ level");
    more.type = "button";
    more.addEventListener("click", () => addLevel(list, ""));
    card.append(list, more);
  }
  $("questions").append(card);
}

function loadExample(name) {
  const example = EXAMPLES[name];
  const json = typeof example.state !== "string";
  $("state-kind").value = json ? "json" : "text";
  $("state").value = json ? JSON.stringify(example.state, null, 2) : example.state;
  checkState();
  $("questions").replaceChildren();
  $("answers").replaceChildren();
  for (const [key, question] of Object.entries(example.questions)) addQuestion(question.type, key, question);
}

$("load-example").addEventListener("click", () => loadExample($("examples").value));
for (const button of document.querySelectorAll("[data-add]")) {
  button.addEventListener("click", () => addQuestion(button.dataset.add));
}

// The request in the System One format, or an error message naming what to fix.
function buildRequest() {
  const state = checkState();
  if (state.error) return {error: "The state is not valid JSON; fix it or switch the state to text."};
  const questions = {};
  for (const card of $("questions").children) {
    const name = card.querySelector(".q-name").value.trim();
    if (!name) return {error: "Every question needs a name."};
    if (name in questions) return {error: `Two questions are named ${name}.`};
    const question = {type: card.dataset.type};
    const text = card.querySelector(".q-instructions").value;
    if (card.querySelector(".q-json").checked) {
      const parsed = parseJSON(text);
      if (parsed.error) return {error: `The instructions of ${name} are not valid JSON: ${parsed.error}`};
      question.instructions = parsed.value;
    } else if (text.trim()) {
      question.instructions = text;
    }
    if (question.type === "choice") {
      question.criteria = {};
      for (const line of card.querySelectorAll(".crit.option")) {
        const id = line.querySelector(".opt-id").value.trim();
        if (id) question.criteria[id] = line.querySelector(".opt-text").value || null;
      }
    } else if (question.type === "noul") {
      const yes = card.querySelector(".noul-true").value, no = card.querySelector(".noul-false").value;
      if (yes || no) question.criteria = Object.assign(yes ? {true: yes} : {}, no ? {false: no} : {});
    } else {
      question.criteria = [...card.querySelectorAll(".level-text")].map((input) => input.value);
    }
    questions[name] = question;
  }
  if (!Object.keys(questions).length) return {error: "Add at least one question."};
  return {value: {state: state.value, questions}};
}

function bar(label, probability, best) {
  const line = el("div", best ? "bar-row best" : "bar-row");
  const track = el("div", "bar");
  const fill = el("div", "fill");
  fill.style.width = `${(probability * 100).toFixed(1)}%`;     // CSSOM, which the page's CSP allows
  track.append(fill);
  line.append(el("span", "bar-label", label), track, el("span", "bar-value", probability.toFixed(3)));
  return line;
}

function showAnswers(result, request) {
  const box = $("answers");
  box.replaceChildren();
  for (const [name, answer] of Object.entries(result.answers)) {
    const card = el("div", "card answer");
    const asked = request.questions[name] || {};
    card.append(el("h3", "", `${name} (${answer.type})`));
    if (answer.type === "choice") {
      card.append(el("p", "verdict", `choice: ${answer.choice}, confidence ${answer.confidence.toFixed(3)}`));
      for (const [id, p] of Object.entries(answer.probabilities)) {
        const description = asked.criteria && asked.criteria[id];
        const label = description ? `${id}: ${asText(description)}` : id;
        card.append(bar(label, p, id === answer.choice));
      }
    } else if (answer.type === "noul") {
      card.append(el("p", "verdict", `yes with probability ${answer.noul.toFixed(3)}`));
      card.append(bar("Yes", answer.noul, answer.noul >= 0.5), bar("No", 1 - answer.noul, answer.noul < 0.5));
    } else {
      const levels = Object.entries(answer.probabilities);
      const top = levels.reduce((a, b) => (b[1] > a[1] ? b : a))[0];
      card.append(el("p", "verdict", `score ${answer.score.toFixed(2)}, confidence ${answer.confidence.toFixed(3)}`));
      for (const [level, p] of levels) {
        const legend = answer.legend[level];
        card.append(bar(`${level}: ${asText(legend)}`, p, level === top));
      }
    }
    box.append(card);
  }
  const usage = result.usage || {};
  const cached = usage.input_tokens_details ? usage.input_tokens_details.cached_tokens : 0;
  box.append(el("p", "muted usage", `model ${result.model}; ${usage.input_tokens} input tokens (${cached} cached)`));
}

async function decide() {
  showError("");
  const built = buildRequest();
  if (built.error) { showError(built.error); return; }
  const button = $("decide");
  button.disabled = true;
  button.textContent = "Asking...";
  try {
    if ($("decision-model").value) built.value.model = $("decision-model").value;
    const response = await api("v1/systemone", {method: "POST", body: JSON.stringify(built.value)});
    showAnswers(await response.json(), built.value);
  } catch (e) {
    if (e.status === 401) askForKey(decide);
    showError(e.message);
  } finally {
    button.disabled = false;
    button.textContent = "Ask the decision model";
  }
}

$("decide").addEventListener("click", decide);

loadExample(Object.keys(EXAMPLES)[0]);
renderConversation();
loadModels();
