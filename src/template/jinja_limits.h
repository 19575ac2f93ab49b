// What one template render may take. A chat template runs on request data (a client's messages,
// tools and chat_template_kwargs) and may come from a --chat-template file, so neither may make the
// renderer overflow its stack, run for hours or fill the memory: past each limit the render stops
// with a TemplateError naming the limit, which the server answers as a 400. The limits sit far above
// what real chat templates need (docs/server.md, "Limits", lists them).
#pragma once
#include <chrono>
#include <cstdint>

namespace sparrow::jinja {

// Expressions and blocks written inside one another in a template's source: ((((x)))), [[[x]]],
// - - - x, a + b + c + ... (each operator nests its left side) and {% if %} inside {% for %} inside ...
// Real templates nest a dozen levels.
constexpr int kMaxSyntaxDepth = 100;

// Lists, tuples, dicts and objects held inside one another. Request JSON nests at most kMaxJsonDepth
// (128, core/json_input.h) levels, so whatever a client sends fits with room for what the template wraps
// around it.
constexpr int kMaxValueDepth = 256;

// Macro calls and recursive-loop calls in progress at once. Chat templates recurse once per level of a
// tool's JSON schema or of a call's arguments, so this exceeds kMaxJsonDepth; jinja2 itself stops at
// about 190 (Python's recursion limit).
constexpr int kMaxCallDepth = 256;

// Statements and expressions being evaluated inside one another at once: what bounds the native stack
// a render takes (about half a KiB per level in a release build, so 1 MiB at most; a render must run on
// a thread with a few MiB of stack) when deep recursion meets deep expressions. Real templates on the
// deepest requests take 4 to 8 levels per level of the request's JSON: about 1,000.
constexpr int kMaxEvalDepth = 2048;

// Loop iterations of one render, all loops (and `if` filters of loops) together: about half a second
// of work. A request of 100,000 messages renders; a loop inside a loop over them does not.
constexpr int64_t kMaxLoopIterations = 1'000'000;

// The processor time one render may take (its thread's CPU time, so a busy server gives a render the
// budget an idle one does). Real templates render the largest request the server accepts in well under
// a second, but some are quadratic in the request (a loop over the messages that slices or concatenates
// them, as Kimi K3's does for runs of tool messages), which a hostile request turns into hours. The
// clock is read every few evaluation steps.
constexpr std::chrono::seconds kMaxRenderTime{10};

// range() results, as jinja2's sandbox (MAX_RANGE), with its error message.
constexpr int64_t kMaxRangeItems = 100'000;

// The bytes of any string a render builds, the rendered prompt included: twice the largest request
// body the server accepts (32 MiB), so every prompt a client can send renders.
constexpr int64_t kMaxStringBytes = int64_t(64) << 20;

// The items of a list a template builds by repetition or concatenation ([x] * n, a + b, batch).
constexpr int64_t kMaxListItems = int64_t(1) << 20;

// Throws the TemplateError of kMaxStringBytes when a string of `bytes` would exceed it.
void check_string_size(int64_t bytes);
// Throws the TemplateError of kMaxListItems when a list of `items` would exceed it.
void check_list_size(int64_t items);

}  // namespace sparrow::jinja
