#include "text/chat.h"

#include <gtest/gtest.h>

// Designated initializers name only the options a test changes.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

#include "gguf/gguf.h"
#include "test_vocab.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dflash::text {
namespace {

using Msgs = std::vector<ChatMessage>;

template <typename F>
void expect_error(F&& f, std::string_view what) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << what << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string_view(e.what()).find(what), std::string_view::npos) << e.what();
  }
}

// Excerpts with the constructs detection keys on (not whole templates).
constexpr const char* kQwen35Excerpt =
    "{%- macro render_content(content, do_vision_count, is_system_content=false) %}...{%- endmacro %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}";

constexpr const char* kBonsaiExcerpt =
    "{%- macro render_content(content, do_vision_count, is_system_content=false) %}...{%- endmacro %}\n"
    "{%- if enable_thinking is undefined or enable_thinking is true %}\n"
    "    {%- set resolved_reasoning_effort = reasoning_effort|default('xhigh') %}\n"
    "    {%- if resolved_reasoning_effort == 'xhigh' %}\n"
    "        {%- set reasoning_instructions = 'Reasoning effort is set to xhigh. Please think carefully through the "
    "task, validate key assumptions, consider plausible alternatives, and prioritize correctness, consistency, and "
    "clarity in the final answer.' %}\n"
    "    {%- elif resolved_reasoning_effort == 'low' %}\n"
    "        {%- set reasoning_instructions = 'Reasoning effort is set to low. Keep your thinking brief and focused, "
    "moving directly to the conclusion without unnecessary elaboration.' %}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- if preserve_thinking is undefined or preserve_thinking is true or loop.index0 > ns.last_query_index %}\n"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}\n"
    "{{- '<|im_end|>\\n' }}{{- '<|im_start|>assistant\\n' }}{{- '<think>\\n\\n</think>\\n\\n' }}{{- '<think>\\n' }}";

constexpr const char* kQwen3Excerpt =
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}\n"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}{{- '<|im_end|>\\n' }}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}";

constexpr const char* kPlainChatml =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const std::string kXhigh =
    "Reasoning effort is set to xhigh. Please think carefully through the task, validate key assumptions, consider "
    "plausible alternatives, and prioritize correctness, consistency, and clarity in the final answer.";

TEST(ChatDetect, RecognisesTheFamilies) {
  const auto q35 = ChatTemplate::detect(kQwen35Excerpt);
  EXPECT_EQ(q35.features().format, ChatFormat::Qwen35);
  EXPECT_TRUE(q35.features().think_prefill);
  EXPECT_TRUE(q35.features().thinking_switch);
  EXPECT_TRUE(q35.features().split_think);
  EXPECT_EQ(q35.features().preserve_default, -1);
  EXPECT_FALSE(q35.features().reasoning_effort);

  const auto bonsai = ChatTemplate::detect(kBonsaiExcerpt);
  EXPECT_EQ(bonsai.features().format, ChatFormat::Qwen35);
  EXPECT_TRUE(bonsai.features().reasoning_effort);
  EXPECT_EQ(bonsai.features().preserve_default, 1);
  EXPECT_FALSE(bonsai.features().split_think);
  EXPECT_EQ(bonsai.features().effort_xhigh, kXhigh);
  EXPECT_EQ(bonsai.features().effort_medium, "");

  const auto q3 = ChatTemplate::detect(kQwen3Excerpt);
  EXPECT_EQ(q3.features().format, ChatFormat::Qwen3);
  EXPECT_FALSE(q3.features().think_prefill);
  EXPECT_TRUE(q3.features().thinking_switch);

  EXPECT_EQ(ChatTemplate::detect(kPlainChatml).features().format, ChatFormat::ChatML);
}

TEST(ChatDetect, UnknownTemplatesAreErrors) {
  expect_error([] { ChatTemplate::detect("{{ bos_token }}{% for m in messages %}[INST] {{ m.content }}"); },
               "starts with: \"{{ bos_token }}{% for m in messages %}[INST]");
  expect_error([] { ChatTemplate::detect("<|im_start|><|im_end|>{% if enable_thinking %}<think>{% endif %}"); },
               "thinking template of unknown shape");
}

// --- Qwen3.5 (official behaviour) -------------------------------------------------------------

TEST(ChatQwen35, GenerationPromptAndThinkingSwitch) {
  const auto t = ChatTemplate::qwen35();
  const Msgs m = {{"user", "What is 2+2?", {}}};
  EXPECT_EQ(t.render(m), "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n");
  EXPECT_EQ(t.render(m, {.enable_thinking = false}),
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(t.render(m, {.add_generation_prompt = false}), "<|im_start|>user\nWhat is 2+2?<|im_end|>\n");
}

TEST(ChatQwen35, SystemTrimAndHistory) {
  const auto t = ChatTemplate::qwen35();
  const Msgs m = {
      {"system", "  Be brief.\n", {}},
      {"user", " Hi \n", {}},
      {"assistant", "<think>\nuser greets\n</think>\n\nHello!", {}},  // reasoning inside content
      {"user", "Bye", {}},
      {"assistant", "See you.", std::string("\n  wave back  \n")},
  };
  // The first assistant turn is before the last user query: its thinking is dropped; the last one
  // keeps its (trimmed) reasoning.
  EXPECT_EQ(t.render(m, {.add_generation_prompt = false}),
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nwave back\n</think>\n\nSee you.<|im_end|>\n");
  // An empty system prompt is still rendered by the official template.
  EXPECT_EQ(t.render({{"system", " ", {}}, {"user", "x", {}}}, {.add_generation_prompt = false}),
            "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nx<|im_end|>\n");
}

TEST(ChatQwen35, ToolResponses) {
  const auto t = ChatTemplate::qwen35();
  const Msgs m = {
      {"user", "weather?", {}},
      {"assistant", "Let me check.", {}},
      {"tool", "sunny", {}},
      {"tool", "22C", {}},
  };
  EXPECT_EQ(t.render(m, {.enable_thinking = false}),
            "<|im_start|>user\nweather?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nLet me check.<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

// A conversation that opens with tool messages: Qwen3.5's template tests loop.previtem, undefined for the
// first message, so no user header opens the run; Qwen3's tests loop.first and opens one.
TEST(ChatQwen35, ToolResponsesFirst) {
  const Msgs m = {{"tool", "sunny", {}}, {"user", "so?", {}}};
  EXPECT_EQ(ChatTemplate::qwen35().render(m, {.add_generation_prompt = false}),
            "\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>user\nso?<|im_end|>\n");
  EXPECT_EQ(ChatTemplate::qwen3().render(m, {.add_generation_prompt = false}),
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>user\nso?<|im_end|>\n");
}

TEST(ChatQwen35, TemplateErrors) {
  const auto t = ChatTemplate::qwen35();
  expect_error([&] { t.render({}); }, "no messages");
  expect_error([&] { t.render({{"system", "s", {}}}); }, "no user query");
  expect_error([&] { t.render({{"user", "<tool_response>x</tool_response>", {}}}); }, "no user query");
  expect_error([&] { t.render({{"user", "a", {}}, {"system", "s", {}}}); }, "system message must be at the beginning");
  expect_error([&] { t.render({{"narrator", "a", {}}}); }, "unknown role 'narrator'");
}

// --- Ternary Bonsai 2 (expected strings: the PrismML llama.cpp fork's renderings) ----------------

TEST(ChatBonsai, ReasoningEffortAndPreservedThinking) {
  const auto t = ChatTemplate::detect(kBonsaiExcerpt);
  EXPECT_EQ(t.render({{"user", "What is 2+2? Answer briefly.", {}}}),
            "<|im_start|>system\n" + kXhigh +
                "<|im_end|>\n<|im_start|>user\nWhat is 2+2? Answer briefly.<|im_end|>\n<|im_start|>assistant\n<think>\n");
  EXPECT_EQ(t.render({{"user", "What is 2+2?", {}}}, {.enable_thinking = false}),
            "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(t.render({{"user", "What is 2+2?", {}}}, {.reasoning_effort = "low"}),
            "<|im_start|>system\nReasoning effort is set to low. Keep your thinking brief and focused, moving directly to "
            "the conclusion without unnecessary elaboration.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n");
  EXPECT_EQ(t.render({{"user", "Q", {}}}, {.reasoning_effort = "medium"}),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n");
  expect_error([&] { t.render({{"user", "Q", {}}}, {.reasoning_effort = "max"}); }, "unexpected reasoning effort 'max'");

  const Msgs history = {
      {"system", "You are a helpful assistant", {}},
      {"user", "Hi", {}},
      {"assistant", "Hello!", std::string("user greets")},
      {"user", "Bye", {}},
  };
  EXPECT_EQ(t.render(history),
            "<|im_start|>system\n" + kXhigh +
                "\n\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                "<think>\nuser greets\n</think>\n\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n");
  // preserve_thinking=false drops the thinking of turns before the last query.
  EXPECT_EQ(t.render(history, {.enable_thinking = false, .preserve_thinking = false}),
            "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

// --- Qwen3 -----------------------------------------------------------------------------------

TEST(ChatQwen3, HeaderAloneWhenThinking) {
  const auto t = ChatTemplate::qwen3();
  const Msgs m = {{"system", "S", {}}, {"user", "Q", {}}};
  EXPECT_EQ(t.render(m), "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.render(m, {.enable_thinking = false}),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(ChatQwen3, History) {
  const auto t = ChatTemplate::qwen3();
  const Msgs m = {
      {"user", "Hi", {}},
      {"assistant", "<think>\nr1\n</think>\n\nHello", {}},
      {"user", " Bye ", {}},  // Qwen3 does not trim
      {"assistant", "\n\nSee you", {}},  // the last turn gets an (empty) think block
  };
  EXPECT_EQ(t.render(m, {.add_generation_prompt = false}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
            "<|im_start|>user\n Bye <|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nSee you<|im_end|>\n");
}

// --- ChatML ----------------------------------------------------------------------------------

TEST(ChatMl, PlainAndQwen25Default) {
  const auto t = ChatTemplate::chatml();
  EXPECT_EQ(t.render({{"user", "hi", {}}}), "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  const auto q25 = ChatTemplate::detect(
      std::string(kPlainChatml) + "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                  "assistant.<|im_end|>\\n' }}");
  EXPECT_EQ(q25.render({{"user", "hi", {}}}),
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
}

// --- From GGUF -------------------------------------------------------------------------------

TEST(ChatGguf, TemplateOrChatmlDefault) {
  const Tokenizer tok(testing::test_config());
  {
    gguf::Writer w;
    w.set("tokenizer.chat_template", gguf::Value::string(kBonsaiExcerpt));
    const auto f = gguf::File::from_bytes(w.to_bytes(), "m.gguf");
    EXPECT_TRUE(ChatTemplate::from_gguf(f, tok).features().reasoning_effort);
  }
  {
    gguf::Writer w;  // no template, but the vocabulary has <|im_start|>
    const auto f = gguf::File::from_bytes(w.to_bytes(), "m.gguf");
    EXPECT_EQ(ChatTemplate::from_gguf(f, tok).features().format, ChatFormat::ChatML);
  }
  {
    gguf::Writer w;
    w.set("tokenizer.chat_template", gguf::Value::string("{{ messages }}"));
    const auto f = gguf::File::from_bytes(w.to_bytes(), "odd.gguf");
    expect_error([&] { ChatTemplate::from_gguf(f, tok); }, "odd.gguf: tokenizer.chat_template: unsupported chat template");
  }
}

}  // namespace
}  // namespace dflash::text
