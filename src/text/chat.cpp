#include "text/chat.h"

#include "gguf/gguf.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "util/error.h"

namespace dflash::text {

namespace {

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kQwen25System = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
// Bonsai 2's instructions, used when they cannot be read out of the template text itself.
constexpr std::string_view kEffortXhigh =
    "Reasoning effort is set to xhigh. Please think carefully through the task, validate key assumptions, consider "
    "plausible alternatives, and prioritize correctness, consistency, and clarity in the final answer.";
constexpr std::string_view kEffortLow =
    "Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to the conclusion without "
    "unnecessary elaboration.";

bool contains(std::string_view s, std::string_view what) { return s.find(what) != std::string_view::npos; }

// Python str methods the templates use.
std::string_view lstrip_nl(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_nl(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}
std::string_view before_first(std::string_view s, std::string_view sep) {  // s.split(sep)[0]
  const size_t p = s.find(sep);
  return p == std::string_view::npos ? s : s.substr(0, p);
}
std::string_view after_last(std::string_view s, std::string_view sep) {  // s.split(sep)[-1]
  const size_t p = s.rfind(sep);
  return p == std::string_view::npos ? s : s.substr(p + sep.size());
}
bool is_tool_response(std::string_view s) {
  return s.starts_with("<tool_response>") && s.ends_with("</tool_response>");
}

// Reads the string literal of `{%- set reasoning_instructions = '...' %}` that follows the branch
// `resolved_reasoning_effort == '<effort>'`; empty when the template has no such branch.
std::string read_effort_text(std::string_view tmpl, std::string_view effort) {
  const std::string branch = "resolved_reasoning_effort == '" + std::string(effort) + "'";
  size_t p = tmpl.find(branch);
  if (p == std::string_view::npos) return {};
  const size_t end_branch = tmpl.find("{%- el", p);  // the branch ends at the next elif/else/endif
  constexpr std::string_view kSet = "set reasoning_instructions = '";
  p = tmpl.find(kSet, p);
  if (p == std::string_view::npos || (end_branch != std::string_view::npos && p > end_branch)) return {};
  p += kSet.size();
  const size_t q = tmpl.find('\'', p);
  if (q == std::string_view::npos) return {};
  return std::string(tmpl.substr(p, q - p));
}

// Tool message i (its content as the template renders it): a user header before the first of a run of
// tool messages, the wrapped response, the end after the last of the run. header_at_start: whether a
// conversation's first message opens a header too (Qwen3's template; Qwen3.5's reads an undefined
// loop.previtem there and opens none).
void append_tool_response(std::string& out, const std::vector<ChatMessage>& msgs, size_t i, std::string_view content,
                          bool header_at_start) {
  if (i == 0 ? header_at_start : msgs[i - 1].role != "tool") out += "<|im_start|>user";
  out += "\n<tool_response>\n" + std::string(content) + "\n</tool_response>";
  if (i + 1 == msgs.size() || msgs[i + 1].role != "tool") out += "<|im_end|>\n";
}

void check_role(const ChatMessage& m, size_t i) {
  DFLASH_CHECK(m.role == "system" || m.role == "user" || m.role == "assistant" || m.role == "tool",
               "chat template: message {} has unknown role '{}' (expected system, user, assistant or tool)", i, m.role);
}

}  // namespace

// =============================================================================================
// Construction and detection

ChatTemplate ChatTemplate::chatml() { return ChatTemplate(Features{}); }

ChatTemplate ChatTemplate::qwen3() {
  Features f;
  f.format = ChatFormat::Qwen3;
  f.thinking_switch = true;
  f.split_think = true;
  return ChatTemplate(f);
}

ChatTemplate ChatTemplate::qwen35() {
  Features f;
  f.format = ChatFormat::Qwen35;
  f.think_prefill = true;
  f.thinking_switch = true;
  f.split_think = true;
  return ChatTemplate(f);
}

ChatTemplate ChatTemplate::detect(std::string_view t) {
  Features f;
  auto fail_unknown = [&](const char* why) {
    std::string head(t.substr(0, 80));
    for (char& c : head) if (c == '\n') c = ' ';
    fail("unsupported chat template ({}); it starts with: \"{}{}\". Supported: the Qwen3.5/Qwen3/Bonsai ChatML "
         "templates and plain ChatML", why, head, t.size() > 80 ? "..." : "");
  };
  if (!contains(t, kImStart) || !contains(t, kImEnd)) fail_unknown("no <|im_start|>/<|im_end|>: not ChatML");
  // '<think>\n' as a literal of its own (the generation prompt), not the '\n<think>\n' of history.
  f.think_prefill = contains(t, "'<think>\\n'");
  f.thinking_switch = contains(t, "enable_thinking");
  f.split_think = contains(t, "split('</think>')");
  if (contains(t, "render_content") && contains(t, "last_query_index")) {
    f.format = ChatFormat::Qwen35;
    if (contains(t, "preserve_thinking is undefined or preserve_thinking is true")) f.preserve_default = 1;
    else if (contains(t, "preserve_thinking is defined and preserve_thinking is true")) f.preserve_default = 0;
    else if (contains(t, "preserve_thinking")) fail_unknown("unrecognised use of preserve_thinking");
    if (contains(t, "reasoning_effort")) {
      f.reasoning_effort = true;
      f.effort_xhigh = read_effort_text(t, "xhigh");
      f.effort_medium = read_effort_text(t, "medium");
      f.effort_low = read_effort_text(t, "low");
      if (f.effort_xhigh.empty()) f.effort_xhigh = kEffortXhigh;
      if (f.effort_low.empty()) f.effort_low = kEffortLow;
    }
  } else if (contains(t, "<think>") && contains(t, "last_query_index")) {
    f.format = ChatFormat::Qwen3;
  } else if (contains(t, "<think>") || contains(t, "enable_thinking")) {
    fail_unknown("a thinking template of unknown shape");
  } else {
    f.format = ChatFormat::ChatML;
    f.default_system = contains(t, kQwen25System);
  }
  return ChatTemplate(std::move(f));
}

ChatTemplate ChatTemplate::from_gguf(const gguf::File& file, const Tokenizer& tokenizer) {
  const std::string t = file.get_string_or("tokenizer.chat_template", "");
  if (!t.empty()) {
    try {
      return detect(t);
    } catch (const Error& e) {
      throw Error(fmt::format("{}: tokenizer.chat_template: {}", file.path(), e.what()));
    }
  }
  DFLASH_CHECK(tokenizer.find_token(kImStart).has_value(),
               "{}: no tokenizer.chat_template and no <|im_start|> token: cannot choose a chat format", file.path());
  return chatml();
}

std::string ChatTemplate::name() const {
  switch (f_.format) {
    case ChatFormat::ChatML: return f_.default_system ? "chatml (qwen2.5)" : "chatml";
    case ChatFormat::Qwen3: return "qwen3";
    case ChatFormat::Qwen35: return f_.reasoning_effort ? "qwen3.5 (bonsai2, reasoning effort)" : "qwen3.5";
  }
  return "?";
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, const ChatOptions& opts) const {
  DFLASH_CHECK(!messages.empty(), "chat template: no messages provided");
  for (size_t i = 0; i < messages.size(); ++i) check_role(messages[i], i);
  switch (f_.format) {
    case ChatFormat::Qwen35: return render_qwen35(messages, opts);
    case ChatFormat::Qwen3: return render_qwen3(messages, opts);
    case ChatFormat::ChatML: return render_chatml(messages, opts);
  }
  return {};
}

// =============================================================================================
// Qwen3.5 family

std::string ChatTemplate::render_qwen35(const std::vector<ChatMessage>& msgs, const ChatOptions& opts) const {
  std::string out;
  const size_t n = msgs.size();

  // {%- if enable_thinking is undefined or enable_thinking is true %} ... reasoning_effort
  std::string_view instructions;
  if (f_.reasoning_effort && opts.enable_thinking) {
    const std::string effort = opts.reasoning_effort.empty() ? "xhigh" : opts.reasoning_effort;
    if (effort == "xhigh") instructions = f_.effort_xhigh;
    else if (effort == "medium") instructions = f_.effort_medium;
    else if (effort == "low") instructions = f_.effort_low;
    else fail("chat template: unexpected reasoning effort '{}' (supported: xhigh (default), medium, low)", effort);
  }

  // System prompt (messages[0] only; render_content(...)|trim).
  if (msgs[0].role == "system") {
    const std::string_view content = python_strip(msgs[0].content);
    if (f_.reasoning_effort) {
      if (!content.empty()) {
        out += "<|im_start|>system\n";
        if (!instructions.empty()) out += std::string(instructions) + "\n\n";
        out += std::string(content) + "<|im_end|>\n";
      } else if (!instructions.empty()) {
        out += "<|im_start|>system\n" + std::string(instructions) + "<|im_end|>\n";
      }
    } else {
      out += "<|im_start|>system\n" + std::string(content) + "<|im_end|>\n";
    }
  } else if (!instructions.empty()) {
    out += "<|im_start|>system\n" + std::string(instructions) + "<|im_end|>\n";
  }

  // ns.last_query_index: the last user message that is not a wrapped tool response.
  size_t last_query = n;  // n: none found
  for (size_t k = n; k-- > 0;) {
    if (msgs[k].role == "user" && !is_tool_response(python_strip(msgs[k].content))) {
      last_query = k;
      break;
    }
  }
  DFLASH_CHECK(last_query != n, "chat template: no user query found in messages");

  bool preserve = false;
  if (f_.preserve_default >= 0) preserve = opts.preserve_thinking.value_or(f_.preserve_default == 1);

  for (size_t i = 0; i < n; ++i) {
    const ChatMessage& m = msgs[i];
    std::string_view content = python_strip(m.content);
    if (m.role == "system") {
      DFLASH_CHECK(i == 0, "chat template: the system message must be at the beginning (found at {})", i);
    } else if (m.role == "user") {
      out += "<|im_start|>user\n" + std::string(content) + "<|im_end|>\n";
    } else if (m.role == "assistant") {
      std::string_view reasoning;
      if (m.reasoning_content) {
        reasoning = *m.reasoning_content;
      } else if (f_.split_think && contains(content, "</think>")) {
        reasoning = lstrip_nl(after_last(rstrip_nl(before_first(content, "</think>")), "<think>"));
        content = lstrip_nl(after_last(content, "</think>"));
      }
      reasoning = python_strip(reasoning);
      if (preserve || i > last_query) {
        out += "<|im_start|>assistant\n<think>\n" + std::string(reasoning) + "\n</think>\n\n" + std::string(content);
      } else {
        out += "<|im_start|>assistant\n" + std::string(content);
      }
      out += "<|im_end|>\n";
    } else {  // tool
      append_tool_response(out, msgs, i, content, /*header_at_start=*/false);
    }
  }
  append_generation_prompt(out, opts);
  return out;
}

void ChatTemplate::append_generation_prompt(std::string& out, const ChatOptions& opts) const {
  if (!opts.add_generation_prompt) return;
  out += "<|im_start|>assistant\n";
  if (f_.thinking_switch && !opts.enable_thinking) out += "<think>\n\n</think>\n\n";
  else if (f_.think_prefill) out += "<think>\n";
}

// =============================================================================================
// Qwen3

std::string ChatTemplate::render_qwen3(const std::vector<ChatMessage>& msgs, const ChatOptions& opts) const {
  std::string out;
  const size_t n = msgs.size();
  if (msgs[0].role == "system") out += "<|im_start|>system\n" + msgs[0].content + "<|im_end|>\n";

  size_t last_query = n - 1;  // the template's default when no user query is found
  for (size_t k = n; k-- > 0;) {
    if (msgs[k].role == "user" && !is_tool_response(msgs[k].content)) {
      last_query = k;
      break;
    }
  }

  for (size_t i = 0; i < n; ++i) {
    const ChatMessage& m = msgs[i];
    std::string_view content = m.content;
    if (m.role == "user" || (m.role == "system" && i > 0)) {
      out += "<|im_start|>" + m.role + "\n" + std::string(content) + "<|im_end|>\n";
    } else if (m.role == "assistant") {
      std::string_view reasoning;
      if (m.reasoning_content) {
        reasoning = *m.reasoning_content;
      } else if (contains(content, "</think>")) {
        reasoning = lstrip_nl(after_last(rstrip_nl(before_first(content, "</think>")), "<think>"));
        content = lstrip_nl(after_last(content, "</think>"));
      }
      if (i > last_query && (i + 1 == n || !reasoning.empty())) {
        out += "<|im_start|>assistant\n<think>\n" + std::string(lstrip_nl(rstrip_nl(reasoning))) + "\n</think>\n\n" +
               std::string(lstrip_nl(content));
      } else {
        out += "<|im_start|>assistant\n" + std::string(content);
      }
      out += "<|im_end|>\n";
    } else if (m.role == "tool") {
      append_tool_response(out, msgs, i, content, /*header_at_start=*/true);
    }
  }
  append_generation_prompt(out, opts);
  return out;
}

// =============================================================================================
// Plain ChatML (and Qwen2.5's default system prompt)

std::string ChatTemplate::render_chatml(const std::vector<ChatMessage>& msgs, const ChatOptions& opts) const {
  std::string out;
  if (f_.default_system && msgs[0].role != "system") {
    out += "<|im_start|>system\n" + std::string(kQwen25System) + "<|im_end|>\n";
  }
  for (const ChatMessage& m : msgs) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  if (opts.add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace dflash::text
