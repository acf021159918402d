#include "eval_tasks.h"

#include <algorithm>
#include <cstdio>
#include <random>

#include "kvtc/error.h"

namespace kvtc::lab {

namespace {

// Portable draws (std::uniform_int_distribution differs between standard
// libraries, and the prompts must not).
uint64_t draw(std::mt19937_64& rng, uint64_t n) {
  return rng() % n;
}

std::string digits(std::mt19937_64& rng, int n) {
  std::string s(1, char('1' + draw(rng, 9)));
  while (int(s.size()) < n) s += char('0' + draw(rng, 10));
  return s;
}

// Each prompt's own draws: a function of the seed, its index and its task.
std::mt19937_64 prompt_rng(uint64_t seed, uint32_t index, const std::string& task) {
  return std::mt19937_64(seed * 1000003 + index * 7919 + std::hash<std::string>{}(task) % 1000);
}

std::string var_name(std::mt19937_64& rng) {
  std::string s;
  for (int i = 0; i < 5; ++i) s += char('A' + draw(rng, 26));
  return s;
}

// The filler as token pieces, so that statements can be inserted at token
// positions (a line break on each side keeps sentences apart).
std::vector<std::string> pieces(const Model& m, const std::string& text, size_t max_tokens) {
  std::vector<int32_t> t = m.tokenize(text);
  std::vector<std::string> out;
  for (int32_t id : t) {
    std::string s = m.token_text(id);
    if (s.empty()) continue;  // BOS and other control tokens
    out.push_back(std::move(s));
    if (out.size() >= max_tokens) break;
  }
  return out;
}

// Joins filler pieces [0, n) with statements inserted before piece index
// at[i] (sorted).
std::string weave(const std::vector<std::string>& f, size_t n, const std::vector<std::pair<size_t, std::string>>& ins) {
  std::string s;
  size_t k = 0;
  for (size_t i = 0; i <= n; ++i) {
    while (k < ins.size() && ins[k].first == i) s += "\n" + ins[k++].second + "\n";
    if (i < n) s += f[i];
  }
  return s;
}

}  // namespace

TaskPrompt make_task_prompt(const Model& m, const std::string& task, const std::string& filler, const std::string& filler_id, uint32_t ctx,
                            uint64_t seed, uint32_t index) {
  std::mt19937_64 rng = prompt_rng(seed, index, task);
  TaskPrompt p;
  p.task = task;
  std::string head, tail;
  std::vector<std::string> stmts;  // inserted at the chosen depths, in order
  std::vector<double> depth;       // fraction of the filler before each
  char idb[160];
  if (task == "niah") {
    static const double kDepths[] = {0.1, 0.3, 0.5, 0.7, 0.9};
    const double d = kDepths[index % 5];
    const std::string key = digits(rng, 7);
    head =
        "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n\n";
    stmts = {"The pass key is " + key + ". Remember it. " + key + " is the pass key."};
    depth = {d};
    tail = "\n\nWhat is the pass key? The pass key is";
    p.answers = {key};
    p.gen_tokens = 12;
    std::snprintf(idb, sizeof idb, "niah depth %.0f%% in %s", 100 * d, filler_id.c_str());
  } else if (task == "vt") {
    const int hops = 4;  // RULER-VT's default chain: 5 variables
    const std::string value = digits(rng, 5);
    std::vector<std::string> names;
    while (names.size() < size_t(hops + 1)) {
      std::string v = var_name(rng);
      if (std::find(names.begin(), names.end(), v) == names.end()) names.push_back(v);
    }
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n";
    stmts.push_back("VAR " + names[0] + " = " + value);
    for (int i = 1; i <= hops; ++i) stmts.push_back("VAR " + names[size_t(i)] + " = VAR " + names[size_t(i - 1)]);
    for (int i = 0; i <= hops; ++i) depth.push_back(0.05 + 0.85 * i / hops + 0.05 * double(draw(rng, 1000)) / 1000);
    tail = "\n\nQuestion: Find all variables that are assigned the value " + value +
           " in the text above. Answer: According to the chain(s) of variable assignment in the text above, " + std::to_string(hops + 1) +
           " variables are assigned the value " + value + ", they are: VAR";
    p.answers = names;
    p.gen_tokens = 40;
    std::snprintf(idb, sizeof idb, "vt %d hops in %s", hops, filler_id.c_str());
  } else if (task == "kvr") {
    // No filler: the JSON object is the whole context.
    head = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{";
    std::vector<std::pair<std::string, std::string>> kv;
    std::string body;
    // Keys: 5-letter names, values: 6-digit numbers. UUIDs (the paper's
    // and Lost in the Middle's) are beyond a 135M model: measured 0/5 at
    // 2K tokens with full UUIDs (27 pairs) and 0/5 with 8-hex keys and
    // values even at 22 pairs; it copies another pair's value.
    auto key = [](std::mt19937_64& r) { return var_name(r); };
    auto val = [](std::mt19937_64& r) { return digits(r, 6); };
    const std::string probe = "\"" + key(rng) + "\": \"" + val(rng) + "\", ";
    const size_t per = m.tokenize(probe).size();
    const size_t fixed =
        m.tokenize(head + "}\n\nKey: \"" + key(rng) + "\"\nThe value associated with the specified key is: \"" + key(rng) + "\": \"").size();
    size_t n = ctx > fixed + 2 * per ? (ctx - fixed) / per : 1;
    while (true) {
      kv.clear();
      std::mt19937_64 r2(rng());
      for (size_t i = 0; i < n; ++i) {
        std::string k = key(r2);
        while (std::any_of(kv.begin(), kv.end(), [&](const auto& e) { return e.first == k; })) k = key(r2);
        kv.push_back({k, val(r2)});
      }
      const size_t ask = n / 3 + size_t(draw(r2, std::max<size_t>(1, n / 3)));  // the middle third
      body.clear();
      for (size_t i = 0; i < n; ++i) body += "\"" + kv[i].first + "\": \"" + kv[i].second + "\"" + (i + 1 < n ? ", " : "");
      // The answer line restates the key as in the object ("key": "), the
      // cue a small model needs to copy the value.
      const std::string text =
          head + body + "}\n\nKey: \"" + kv[ask].first + "\"\nThe value associated with the specified key is: \"" + kv[ask].first + "\": \"";
      p.tokens = m.tokenize(text);
      if (p.tokens.size() <= ctx || n <= 1) {
        p.answers = {kv[ask].second};
        std::snprintf(idb, sizeof idb, "kvr %zu pairs, key %zu", n, ask);
        break;
      }
      n -= (p.tokens.size() - ctx + per - 1) / per;
    }
    p.gen_tokens = 12;
    p.id = idb;
    require(p.tokens.size() <= ctx, "eval: kvr prompt does not fit the context");
    return p;
  } else {
    throw Error("eval: unknown task '" + task + "'");
  }
  const size_t fixed = m.tokenize(weave({}, 0, {}) + head + tail).size() + [&] {
    size_t s = 0;
    for (const auto& st : stmts) s += m.tokenize(st).size() + 2;
    return s;
  }();
  require(ctx > fixed + 64, "eval: context too short for task " + task);
  std::vector<std::string> f = pieces(m, filler, ctx);
  size_t n = std::min(f.size(), size_t(ctx - fixed - 8));
  for (int attempt = 0; attempt < 4; ++attempt) {
    std::vector<std::pair<size_t, std::string>> ins;
    for (size_t i = 0; i < stmts.size(); ++i) ins.push_back({size_t(depth[i] * double(n)), stmts[i]});
    std::stable_sort(ins.begin(), ins.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    p.tokens = m.tokenize(head + weave(f, n, ins) + tail);
    if (p.tokens.size() <= ctx) break;
    n -= std::min(n, p.tokens.size() - ctx + 4);
  }
  require(p.tokens.size() <= ctx, "eval: " + task + " prompt does not fit the context");
  require(n + 64 >= ctx - fixed - 8 || f.size() < ctx - fixed - 8, "eval: " + task + " prompt lost too much filler");
  p.id = idb;
  return p;
}

namespace {

std::string strip(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

// A line worth predicting: 8+ characters of code, not a comment; a lone
// docstring quote or bracket is not a prediction either.
// The line starting at byte `start`, without its line break.
std::string line_at(const std::string& code, size_t start) {
  const size_t e = code.find('\n', start);
  return code.substr(start, e == std::string::npos ? std::string::npos : e - start);
}

bool code_target(const std::string& line) {
  const std::string t = strip(line);
  return t.size() >= 8 && t[0] != '#' && t.rfind("\"\"\"", 0) != 0 && t.rfind("'''", 0) != 0;
}

}  // namespace

TaskPrompt make_code_prompt(const Model& m, const std::string& code, const std::string& file_id, uint32_t ctx, uint64_t seed, uint32_t index) {
  std::mt19937_64 rng = prompt_rng(seed, index, "code");
  std::vector<size_t> starts{0};  // line starts (bytes)
  for (size_t i = 0; i + 1 < code.size(); ++i)
    if (code[i] == '\n') starts.push_back(i + 1);
  // Tokens before each line start, from the pieces' byte offsets (one
  // tokenization of the file; the prompt itself is re-tokenized below).
  std::vector<size_t> tok_end;  // byte offset after each text token
  size_t off = 0;
  for (int32_t id : m.tokenize(code, false, false)) {
    off += m.token_text(id).size();
    tok_end.push_back(off);
  }
  auto tokens_before = [&](size_t byte) { return size_t(std::upper_bound(tok_end.begin(), tok_end.end(), byte) - tok_end.begin()); };
  std::vector<size_t> full, any;  // candidate target lines
  for (size_t l = 1; l < starts.size(); ++l) {
    if (!code_target(line_at(code, starts[l]))) continue;
    any.push_back(l);
    if (tokens_before(starts[l]) + 16 >= ctx) full.push_back(l);
  }
  require(!any.empty(), "eval: " + file_id + " has no line to complete");
  const std::vector<size_t>& cand = full.empty() ? any : full;
  const size_t l = full.empty() ? any.back() : cand[size_t(draw(rng, cand.size()))];
  TaskPrompt p;
  p.task = "code";
  p.answers = {strip(line_at(code, starts[l]))};
  p.gen_tokens = 64;  // a line; generation stops at its end (eval.cpp)
  // The window: whole lines before the target, the most that fit in ctx.
  const size_t want = tokens_before(starts[l]) > ctx - 8 ? tokens_before(starts[l]) - (ctx - 8) : 0;
  size_t first = size_t(std::lower_bound(starts.begin(), starts.begin() + long(l), want ? tok_end[want - 1] : 0) - starts.begin());
  first = std::min(first, l - 1);  // at least the line before the target
  while (true) {
    p.tokens = m.tokenize(code.substr(starts[first], starts[l] - starts[first]));
    if (p.tokens.size() <= ctx || first + 1 >= l) break;
    ++first;
  }
  require(p.tokens.size() <= ctx, "eval: code prompt of " + file_id + " does not fit the context");
  char idb[200];
  std::snprintf(idb, sizeof idb, "code %s line %zu", file_id.c_str(), l + 1);
  p.id = idb;
  return p;
}

std::string first_code_line(const std::string& generated) {
  size_t a = 0;
  while (a < generated.size()) {
    size_t e = generated.find('\n', a);
    if (e == std::string::npos) e = generated.size();
    const std::string t = strip(generated.substr(a, e - a));
    if (!t.empty()) return t;
    a = e + 1;
  }
  return {};
}

CodeLineScore score_code_line(const std::string& target, const std::string& generated) {
  const std::string a = strip(target), b = first_code_line(generated);
  CodeLineScore s;
  s.exact = a == b ? 1 : 0;
  if (a.empty() && b.empty()) {
    s.edit_similarity = 1;
    return s;
  }
  // LCS by one rolling row (lines are short: O(|a| |b|) is microseconds).
  std::vector<size_t> row(b.size() + 1, 0);
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = 0;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = a[i - 1] == b[j - 1] ? diag + 1 : std::max(row[j], row[j - 1]);
      diag = up;
    }
  }
  s.edit_similarity = 2.0 * double(row[b.size()]) / double(a.size() + b.size());
  return s;
}

double score_generation(const TaskPrompt& p, const std::string& generated) {
  if (p.answers.empty()) return 0;
  size_t hit = 0;
  for (const auto& a : p.answers)
    if (generated.find(a) != std::string::npos) ++hit;
  return double(hit) / double(p.answers.size());
}

}  // namespace kvtc::lab
