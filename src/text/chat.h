// Chat templates: renders a conversation into the prompt text the model was trained on.
//
// No Jinja engine: the known templates of the Qwen family (all ChatML) are recognised from
// tokenizer.chat_template by distinctive substrings and rendered by code that mirrors them line by
// line (each branch below names the template construct it reproduces):
//   Qwen35  Qwen3.5 / Qwen3.6 / Ternary Bonsai 2 ("render_content" + "enable_thinking"): contents
//           trimmed; generation prompt "<|im_start|>assistant\n<think>\n", or with thinking off
//           "<|im_start|>assistant\n<think>\n\n</think>\n\n"; assistant turns after the last user
//           query (or all, with preserve_thinking) keep "<think>\n{reasoning}\n</think>\n\n".
//           Bonsai 2 adds a reasoning-effort instruction to the system prompt while thinking is on.
//   Qwen3   Qwen3 (enable_thinking, no render_content): generation prompt is the header alone, plus
//           "<think>\n\n</think>\n\n" with thinking off; history as in the Qwen3 template.
//   ChatML  plain "<|im_start|>{role}\n{content}<|im_end|>\n" (Qwen2.5 adds its default system
//           prompt). Also the default for a GGUF without a template whose vocabulary has <|im_start|>.
// Anything else is an error that quotes the template's first characters.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dflash::gguf {
class File;
}

namespace dflash::text {

class Tokenizer;

struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant" | "tool"
  std::string content;
  std::optional<std::string> reasoning_content;  // an assistant turn's thinking, when kept apart
};

struct ChatOptions {
  bool add_generation_prompt = true;
  bool enable_thinking = true;
  std::optional<bool> preserve_thinking;  // templates with the switch; nullopt: the template's default
  std::string reasoning_effort;           // Bonsai 2: "" (template default, xhigh) | xhigh | medium | low
};

enum class ChatFormat { ChatML, Qwen3, Qwen35 };

class ChatTemplate {
 public:
  // What the recognised template does (see the header comment).
  struct Features {
    ChatFormat format = ChatFormat::ChatML;
    bool think_prefill = false;        // "<think>\n" after the generation header when thinking is on
    bool thinking_switch = false;      // honours enable_thinking=false ("<think>\n\n</think>\n\n")
    bool split_think = false;          // takes reasoning out of "...</think>" in assistant content
    int preserve_default = -1;         // -1: no preserve_thinking switch; else its default (0/1)
    bool reasoning_effort = false;     // Bonsai 2's effort instructions in the system prompt
    bool default_system = false;       // Qwen2.5's "You are Qwen, created by Alibaba Cloud..."
    std::string effort_xhigh, effort_medium, effort_low;  // the instructions, taken from the template
  };

  explicit ChatTemplate(Features f) : f_(std::move(f)) {}
  static ChatTemplate chatml();
  static ChatTemplate qwen3();
  static ChatTemplate qwen35();  // the official Qwen3.5 template's behaviour

  // Recognises a tokenizer.chat_template text; throws dflash::Error for an unknown template.
  static ChatTemplate detect(std::string_view template_text);
  // tokenizer.chat_template when present; else ChatML when the vocabulary has <|im_start|>.
  static ChatTemplate from_gguf(const gguf::File& file, const Tokenizer& tokenizer);

  // Throws dflash::Error where the template raises (no messages, no user query, system message
  // not first, unknown role, unknown reasoning effort).
  std::string render(const std::vector<ChatMessage>& messages, const ChatOptions& opts = {}) const;

  const Features& features() const { return f_; }
  std::string name() const;

 private:
  std::string render_qwen35(const std::vector<ChatMessage>& messages, const ChatOptions& opts) const;
  std::string render_qwen3(const std::vector<ChatMessage>& messages, const ChatOptions& opts) const;
  std::string render_chatml(const std::vector<ChatMessage>& messages, const ChatOptions& opts) const;
  // The assistant header that ends a prompt (add_generation_prompt), with the think block the features ask for.
  void append_generation_prompt(std::string& out, const ChatOptions& opts) const;
  Features f_;
};

inline std::string render_chat(const ChatTemplate& tmpl, const std::vector<ChatMessage>& messages,
                               const ChatOptions& opts = {}) {
  return tmpl.render(messages, opts);
}

}  // namespace dflash::text
