#include <dlfcn.h>
#include <ggml-backend.h>
#include <gguf.h>
#include <llama.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "core/capture_io.h"
#include "core/util.h"
#include "kvtc/error.h"
#include "kvtc/llama.h"

namespace kvtc {

namespace {

std::mutex g_log_mu;
bool g_verbose = false;
std::string g_last_errors;  // last few ERROR lines from llama.cpp

void log_cb(ggml_log_level level, const char* text, void*) {
  std::lock_guard<std::mutex> lk(g_log_mu);
  if (level == GGML_LOG_LEVEL_ERROR) {
    g_last_errors += text;
    if (g_last_errors.size() > 2000) g_last_errors.erase(0, g_last_errors.size() - 2000);
  }
  if (g_verbose) std::fputs(text, stderr);
}

std::string take_llama_errors() {
  std::lock_guard<std::mutex> lk(g_log_mu);
  std::string s;
  s.swap(g_last_errors);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? "" : " (llama.cpp: " + s + ")";
}

// "zen4" for libggml-cpu-zen4.so; "" for another file name.
std::string cpu_variant_of(const std::string& file_name) {
  const std::string pre = "libggml-cpu-", ext = ".so";
  const size_t n = file_name.size();
  if (n <= pre.size() + ext.size() || file_name.rfind(pre, 0) != 0 || file_name.compare(n - ext.size(), ext.size(), ext) != 0) return "";
  return file_name.substr(pre.size(), n - pre.size() - ext.size());
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : " ") + x;
  return s.empty() ? "none" : s;
}

// ggml's CPU code is not linked in: llama.cpp is built with one loadable
// module per CPU variant, libggml-cpu-<variant>.so (scripts/bootstrap.sh),
// in KVTC_GGML_BACKEND_DIR beside libllama.so. ggml scores each by the
// features it was built for and loads the best this CPU runs (zen4 on an
// AVX-512/VNNI/BF16 CPU: Qwen prefill +30-37% over haswell,
// bench/results/prefill-isa.md). KVTC_GGML_CPU=<variant> loads that one
// instead (kvtc calibrate pins haswell: its K/V, and so the calibration's
// bytes, then match on every x86-64-v3 CPU). Only this folder is searched,
// not the current directory as ggml_backend_load_all() would.
void load_cpu_backend() {
  if (ggml_backend_reg_by_name("CPU") != nullptr) return;  // a host program (llama-server) loaded it already
  const std::string dir = KVTC_GGML_BACKEND_DIR;
  const std::string want = llama_cpu_requested();
  if (!want.empty()) {
    const std::vector<std::string> built = llama_cpu_variants();
    require(std::find(built.begin(), built.end(), want) != built.end(),
            "KVTC_GGML_CPU=" + want + ": no such ggml CPU variant in " + dir + " (built: " + joined(built) + "; or auto)");
    const std::string path = dir + "/libggml-cpu-" + want + ".so";
    require(ggml_backend_load(path.c_str()) != nullptr, "KVTC_GGML_CPU=" + want + ": " + path +
                                                            " does not run on this CPU (it lacks an instruction set the variant was built for)" +
                                                            take_llama_errors());
  } else {
    ggml_backend_load_all_from_path(dir.c_str());
  }
  require(ggml_backend_reg_by_name("CPU") != nullptr, "no ggml CPU backend could be loaded from " + dir + " (variants there: " +
                                                          joined(llama_cpu_variants()) + "; run scripts/bootstrap.sh)" + take_llama_errors());
}

void backend_init_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    llama_log_set(log_cb, nullptr);
    load_cpu_backend();
    llama_backend_init();
  });
}

struct GgufCloser {
  void operator()(gguf_context* g) const { gguf_free(g); }
};

std::string gguf_str(gguf_context* g, const std::string& key) {
  int64_t id = gguf_find_key(g, key.c_str());
  if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) return "";
  return gguf_get_val_str(g, id);
}

bool gguf_num(gguf_context* g, const std::string& key, double* out) {
  int64_t id = gguf_find_key(g, key.c_str());
  if (id < 0) return false;
  switch (gguf_get_kv_type(g, id)) {
    case GGUF_TYPE_UINT8: *out = gguf_get_val_u8(g, id); return true;
    case GGUF_TYPE_INT8: *out = gguf_get_val_i8(g, id); return true;
    case GGUF_TYPE_UINT16: *out = gguf_get_val_u16(g, id); return true;
    case GGUF_TYPE_INT16: *out = gguf_get_val_i16(g, id); return true;
    case GGUF_TYPE_UINT32: *out = gguf_get_val_u32(g, id); return true;
    case GGUF_TYPE_INT32: *out = gguf_get_val_i32(g, id); return true;
    case GGUF_TYPE_UINT64: *out = double(gguf_get_val_u64(g, id)); return true;
    case GGUF_TYPE_INT64: *out = double(gguf_get_val_i64(g, id)); return true;
    case GGUF_TYPE_FLOAT32: *out = gguf_get_val_f32(g, id); return true;
    case GGUF_TYPE_FLOAT64: *out = gguf_get_val_f64(g, id); return true;
    case GGUF_TYPE_BOOL: *out = gguf_get_val_bool(g, id); return true;
    default: return false;
  }
}

void check_gguf_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  require(fs::exists(path, ec), path + ": model file not found");
  require(fs::is_regular_file(path, ec), path + ": model path is not a regular file");
  FILE* f = std::fopen(path.c_str(), "rb");
  require(f != nullptr, path + ": cannot open model file: " + std::strerror(errno));
  char magic[4] = {0, 0, 0, 0};
  size_t n = std::fread(magic, 1, 4, f);
  std::fclose(f);
  require(n == 4 && std::memcmp(magic, "GGUF", 4) == 0, path + ": not a GGUF model (the file does not start with the magic 'GGUF')");
}

const char* rope_type_name(int t) {
  switch (t) {
    case LLAMA_ROPE_TYPE_NONE: return "none";
    case LLAMA_ROPE_TYPE_NORM: return "norm";
    case LLAMA_ROPE_TYPE_NEOX: return "neox";
    case LLAMA_ROPE_TYPE_MROPE: return "mrope";
    case LLAMA_ROPE_TYPE_IMROPE: return "imrope";
    case LLAMA_ROPE_TYPE_VISION: return "vision";
    default: return "unknown";
  }
}

// Model facts from the GGUF header (and the rope_freqs tensor), read with
// ggml's own parser so they are exactly what llama.cpp reads.
void read_gguf_info(const std::string& path, ModelInfo& mi, uint32_t* swa_period) {
  gguf_init_params p{true, nullptr};
  std::unique_ptr<gguf_context, GgufCloser> g(gguf_init_from_file(path.c_str(), p));
  require(g != nullptr, path + ": GGUF header could not be parsed" + take_llama_errors());
  mi.arch = gguf_str(g.get(), "general.architecture");
  mi.name = gguf_str(g.get(), "general.name");
  const std::string a = mi.arch + ".";
  double x;
  if (gguf_num(g.get(), a + "rope.dimension_count", &x)) mi.n_rot = uint32_t(x);
  mi.rope_freq_base = gguf_num(g.get(), a + "rope.freq_base", &x) ? float(x) : 10000.0f;
  mi.rope_scaling_type = gguf_str(g.get(), a + "rope.scaling.type");
  if (gguf_num(g.get(), a + "rope.scaling.factor", &x)) mi.rope_scaling_factor = float(x);
  if (gguf_num(g.get(), a + "rope.scaling.original_context_length", &x)) mi.rope_scaling_orig_ctx = uint32_t(x);
  if (gguf_num(g.get(), a + "attention.key_length", &x)) mi.head_dim_k = uint32_t(x);
  if (gguf_num(g.get(), a + "attention.value_length", &x)) mi.head_dim_v = uint32_t(x);
  mi.rope_freq_base_swa = gguf_num(g.get(), a + "rope.freq_base_swa", &x) ? float(x) : 10000.0f;
  int64_t t = gguf_find_tensor(g.get(), "rope_freqs.weight");
  if (t >= 0) {
    require(gguf_get_tensor_type(g.get(), t) == GGML_TYPE_F32, path + ": tensor rope_freqs.weight is not F32");
    const int64_t* ne = gguf_get_tensor_ne(g.get(), t);
    require(ne[0] > 0 && ne[0] <= 65536, path + ": tensor rope_freqs.weight has an implausible length");
    mi.rope_freq_factors.resize(size_t(ne[0]));
    FILE* f = std::fopen(path.c_str(), "rb");
    require(f != nullptr, path + ": cannot reopen for rope_freqs.weight");
    size_t off = gguf_get_data_offset(g.get()) + gguf_get_tensor_offset(g.get(), t);
    bool ok = std::fseek(f, long(off), SEEK_SET) == 0 &&
              std::fread(mi.rope_freq_factors.data(), 4, mi.rope_freq_factors.size(), f) == mi.rope_freq_factors.size();
    std::fclose(f);
    require(ok, path + ": cannot read tensor rope_freqs.weight");
  }
  // SWA layer pattern as llama.cpp derives it (llama_hparams::set_swa_pattern).
  int64_t pid = gguf_find_key(g.get(), (a + "attention.sliding_window_pattern").c_str());
  if (pid >= 0 && gguf_get_kv_type(g.get(), pid) == GGUF_TYPE_ARRAY && gguf_get_arr_type(g.get(), pid) == GGUF_TYPE_BOOL) {
    const bool* arr = static_cast<const bool*>(gguf_get_arr_data(g.get(), pid));
    size_t n = gguf_get_arr_n(g.get(), pid);
    mi.swa_layer.assign(arr, arr + n);
  } else if (gguf_num(g.get(), a + "attention.sliding_window_pattern", &x)) {
    *swa_period = uint32_t(x);
  }
}

// The hyperparameters llama.cpp loaded (after read_gguf_info): layers,
// heads, dims, RoPE type and scale, the sliding-window layers.
void fill_from_model(const llama_model* md, uint32_t swa_period, ModelInfo& mi) {
  mi.n_vocab = uint32_t(llama_vocab_n_tokens(llama_model_get_vocab(md)));
  char buf[256];
  llama_model_desc(md, buf, sizeof buf);
  mi.desc = buf;
  mi.n_params = llama_model_n_params(md);
  mi.n_layer = uint32_t(llama_model_n_layer(md));
  mi.n_head = uint32_t(llama_model_n_head(md));
  mi.n_head_kv = uint32_t(llama_model_n_head_kv(md));
  mi.n_embd = uint32_t(llama_model_n_embd(md));
  mi.n_ctx_train = uint32_t(llama_model_n_ctx_train(md));
  mi.rope_type = rope_type_name(llama_model_rope_type(md));
  mi.rope_freq_scale = llama_model_rope_freq_scale_train(md);
  if (mi.head_dim_k == 0 && mi.n_head) mi.head_dim_k = mi.n_embd / mi.n_head;
  if (mi.head_dim_v == 0 && mi.n_head) mi.head_dim_v = mi.n_embd / mi.n_head;
  if (mi.n_rot == 0) mi.n_rot = mi.head_dim_k;
  mi.n_swa = uint32_t(std::max(0, llama_model_n_swa(md)));
  if (mi.n_swa == 0) {
    mi.swa_layer.assign(mi.n_layer, false);
  } else if (mi.swa_layer.empty()) {
    // Period p: layer il is SWA when il % p < p - 1 (Gemma 3 default p = 6).
    uint32_t p = swa_period ? swa_period : (mi.arch == "gemma3" ? 6u : 0u);
    require(p > 0, mi.path + ": sliding-window model without a layer pattern kvtc understands");
    mi.swa_layer.resize(mi.n_layer);
    for (uint32_t il = 0; il < mi.n_layer; ++il) mi.swa_layer[il] = il % p < p - 1;
  } else {
    mi.swa_layer.resize(mi.n_layer, false);
  }
}

}  // namespace

std::string llama_cpu_build() {
  backend_init_once();
  // The module that holds the CPU backend's functions names the variant.
  ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
  void* fn = reg != nullptr ? ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features") : nullptr;
  Dl_info info{};
  if (fn == nullptr || dladdr(fn, &info) == 0 || info.dli_fname == nullptr) return "unknown";
  const std::string f = std::filesystem::path(info.dli_fname).filename().string();
  const std::string name = cpu_variant_of(f);
  return name.empty() ? f : name;
}

std::vector<std::string> llama_cpu_variants() {
  std::vector<std::string> v;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(KVTC_GGML_BACKEND_DIR, ec)) {
    const std::string name = cpu_variant_of(e.path().filename().string());
    if (!name.empty()) v.push_back(name);
  }
  std::sort(v.begin(), v.end());
  return v;
}

std::string llama_cpu_requested() {
  const char* e = std::getenv("KVTC_GGML_CPU");
  return e == nullptr || std::strcmp(e, "auto") == 0 ? "" : e;
}

std::vector<NamedModel> named_models() {
  const std::string dir = KVTC_MODELS_DIR;
  std::vector<NamedModel> v = {
      {"smollm2", dir + "/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct Q4_1 (llama, the default)", "make bootstrap"},
      {"gemma3", dir + "/gemma-3-270m-q4_k_m.gguf", "Gemma 3 270M Q4_K_M (gemma3, sliding-window layers)", "make bootstrap"},
      {"qwen", dir + "/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 32K context)", "make models-large"},
  };
  for (NamedModel& m : v) {
    std::error_code ec;
    m.present = std::filesystem::is_regular_file(m.path, ec);
  }
  return v;
}

std::string resolve_model(const std::string& name_or_path) {
  for (const NamedModel& m : named_models())
    if (m.name == name_or_path) {
      require(m.present, "model '" + m.name + "' (" + m.what + ") is not fetched yet: run `" + m.how + "` (" + m.path + ")");
      return m.path;
    }
  return name_or_path;
}

std::string default_model_path() {
  const char* e = std::getenv("KVTC_MODEL");
  if (!e || !*e) return KVTC_DEFAULT_MODEL;
  for (const NamedModel& m : named_models())
    if (m.name == e) return m.path;  // a missing file is reported where it is opened
  return e;
}

std::string default_corpus_dir() {
  const char* e = std::getenv("KVTC_CORPUS");
  return e && *e ? e : KVTC_DEFAULT_CORPUS;
}

void set_llama_verbose(bool on) {
  std::lock_guard<std::mutex> lk(g_log_mu);
  g_verbose = on;
}

std::unique_ptr<Model> Model::load(const std::string& path, bool vocab_only) {
  backend_init_once();
  check_gguf_file(path);
  std::unique_ptr<Model> m(new Model());
  ModelInfo& mi = m->info_;
  mi.path = path;
  mi.file_size = std::filesystem::file_size(path);
  uint32_t swa_period = 0;  // from <arch>.attention.sliding_window_pattern when it is a number
  read_gguf_info(path, mi, &swa_period);
  llama_model_params mp = llama_model_default_params();
  mp.vocab_only = vocab_only;
  mp.n_gpu_layers = 0;
  take_llama_errors();
  m->model_ = llama_model_load_from_file(path.c_str(), mp);
  require(m->model_ != nullptr, path + ": llama.cpp could not load this model" + take_llama_errors());
  mi.n_vocab = uint32_t(llama_vocab_n_tokens(llama_model_get_vocab(m->model_)));
  if (vocab_only) return m;  // llama.cpp loads no hyperparameters then: querying them aborts
  fill_from_model(m->model_, swa_period, mi);
  return m;
}

Model::~Model() {
  if (model_) llama_model_free(model_);
}

std::vector<int32_t> Model::tokenize(const std::string& text) const {
  return tokenize(text, llama_vocab_get_add_bos(llama_model_get_vocab(model_)), false);
}

std::vector<int32_t> Model::tokenize(const std::string& text, bool add_bos, bool parse_special) const {
  const llama_vocab* v = llama_model_get_vocab(model_);
  require(text.size() < size_t(INT32_MAX) / 2, "tokenize: text too large");
  std::vector<llama_token> out(text.size() + 8);
  int n = llama_tokenize(v, text.data(), int32_t(text.size()), out.data(), int32_t(out.size()), add_bos, parse_special);
  if (n < 0) {
    out.resize(size_t(-n));
    n = llama_tokenize(v, text.data(), int32_t(text.size()), out.data(), int32_t(out.size()), add_bos, parse_special);
  }
  require(n >= 0, "tokenize: llama.cpp failed to tokenize the text");
  out.resize(size_t(n));
  return out;
}

std::string Model::token_text(int32_t token) const {
  const llama_vocab* v = llama_model_get_vocab(model_);
  char buf[256];
  int n = llama_token_to_piece(v, token, buf, sizeof buf, 0, false);
  return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

const std::string& Model::sha256() const {
  if (sha256_.empty()) sha256_ = sha256_file(info_.path);
  return sha256_;
}

bool Model::is_eog(int32_t token) const {
  return llama_vocab_is_eog(llama_model_get_vocab(model_), token);
}

namespace {

// The rotation llama.cpp applies to this model's stored keys, as kvtc::Rope
// (rope_from_facts on the GGUF facts).
Rope rope_of(const ModelInfo& mi, bool swa) {
  RopeFacts f;
  f.type_name = "rope type";
  f.scaling_name = "rope scaling";
  f.factors_name = "rope_freqs";
  f.type = mi.rope_type;
  f.scaling = mi.rope_scaling_type.empty() ? "none" : mi.rope_scaling_type;
  f.n_rot = mi.n_rot;
  f.freq_base = swa ? mi.rope_freq_base_swa : mi.rope_freq_base;
  f.freq_scale = swa ? mi.rope_freq_scale_swa : mi.rope_freq_scale;
  if (!swa) f.freq_factors = mi.rope_freq_factors;
  // YaRN's parameters are the context's: llama.cpp resolves them from the
  // GGUF and the flags when it creates one (its magnitude factor from the
  // scaling factor and, for some models, rope_yarn_log_mul).
  // geometry_with_settings(context_kv_settings) completes this rotation
  // with them; without a context it stays unsupported.
  if (f.scaling == "yarn")
    f.yarn_error =
        "the GGUF's rope scaling 'yarn' takes its parameters from a context (llama.cpp resolves them when it creates one): "
        "code this model's keys with a context's settings (kvtc-server, Session::capture, KvtcCache)";
  return rope_from_facts(f, mi.head_dim_k, mi.path);
}

CacheGeometry geometry_of(const ModelInfo& mi, const std::string& sha256) {
  require(mi.head_dim_k == mi.head_dim_v, mi.path + ": K head_dim " + std::to_string(mi.head_dim_k) + " differs from V head_dim " +
                                              std::to_string(mi.head_dim_v) + "; not supported by capture format v1");
  CacheGeometry g;
  g.model_sha256 = sha256;
  std::vector<int32_t> base, swa;
  for (uint32_t il = 0; il < mi.n_layer; ++il) (mi.swa_layer[il] ? swa : base).push_back(int32_t(il));
  BlockGeometry b0;
  b0.layers = base;
  b0.n_head_kv = mi.n_head_kv;
  b0.head_dim = mi.head_dim_k;
  b0.rope = rope_of(mi, false);
  g.blocks.push_back(b0);
  if (mi.n_swa > 0) {
    BlockGeometry b1 = b0;
    b1.layers = swa;
    b1.sliding_window = mi.n_swa;
    b1.rope = rope_of(mi, true);
    g.blocks.push_back(b1);
  }
  return g;
}

}  // namespace

CacheGeometry Model::geometry() const {
  return geometry_of(info_, sha256());
}

CacheGeometry model_geometry(const llama_model* m, const std::string& gguf_path) {
  require(m != nullptr, "model_geometry: no model");
  check_gguf_file(gguf_path);
  ModelInfo mi;
  mi.path = gguf_path;
  mi.file_size = std::filesystem::file_size(gguf_path);
  uint32_t swa_period = 0;
  read_gguf_info(gguf_path, mi, &swa_period);
  fill_from_model(m, swa_period, mi);
  return geometry_of(mi, sha256_file(gguf_path));
}

StateLayout context_state_layout(llama_context* ctx, const CacheGeometry& g, int32_t probe_seq) {
  require(ctx != nullptr, "context_state_layout: no context");
  const llama_model* model = llama_get_model(ctx);
  llama_memory_t mem = llama_get_memory(ctx);
  require(llama_memory_seq_pos_max(mem, probe_seq) < 0,
          "context_state_layout: sequence " + std::to_string(probe_seq) + " holds tokens; the probe needs an empty one");
  const llama_vocab* vocab = llama_model_get_vocab(model);
  llama_token tok = llama_vocab_bos(vocab);
  if (tok == LLAMA_TOKEN_NULL) tok = 0;
  llama_batch b = llama_batch_init(1, 0, 1);
  b.n_tokens = 1;
  b.token[0] = tok;
  b.pos[0] = 0;
  b.n_seq_id[0] = 1;
  b.seq_id[0][0] = probe_seq;
  b.logits[0] = 0;
  const int rc = llama_decode(ctx, b);
  llama_batch_free(b);
  std::vector<uint8_t> blob;
  if (rc == 0) {
    blob.resize(llama_state_seq_get_size_ext(ctx, probe_seq, LLAMA_STATE_SEQ_FLAGS_NONE));
    blob.resize(llama_state_seq_get_data_ext(ctx, blob.data(), blob.size(), probe_seq, LLAMA_STATE_SEQ_FLAGS_NONE));
  }
  llama_memory_seq_rm(mem, probe_seq, -1, -1);
  require(rc == 0, "context_state_layout: could not decode a probe token (llama_decode returned " + std::to_string(rc) + ")");
  StateLayout l = state_layout_of(blob, "the context's state");
  (void)capture_from_state(blob, g, "the context's cache (kvtc codes f16 caches: --cache-type-k/v f16)");
  l.seq_id = probe_seq;
  return l;
}

Session::Session(const Model& model, const SessionOptions& opt) : model_(model), opt_(opt) {
  llama_context_params cp = llama_context_default_params();
  n_ctx_ = opt.n_ctx ? opt.n_ctx : model.info().n_ctx_train;
  cp.n_ctx = n_ctx_;
  cp.n_batch = std::min(opt.n_batch, n_ctx_);
  cp.n_ubatch = std::min(opt.n_ubatch, cp.n_batch);
  cp.n_seq_max = 1;
  int nt = opt.n_threads > 0 ? opt.n_threads : int(std::max(1u, std::thread::hardware_concurrency()));
  cp.n_threads = nt;
  cp.n_threads_batch = nt;
  // Every setting that changes the state blob is fixed, never AUTO.
  cp.flash_attn_type = opt.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  auto cache_type = [](const std::string& t) {
    if (t == "f16") return GGML_TYPE_F16;
    if (t == "q8_0") return GGML_TYPE_Q8_0;
    if (t == "q4_0") return GGML_TYPE_Q4_0;
    throw Error("session: cache type must be f16, q8_0 or q4_0, got '" + t + "'");
  };
  cp.type_k = cache_type(opt.cache_type_k);
  cp.type_v = cache_type(opt.cache_type_v);
  // llama.cpp quantizes V only with flash attention (the transposed V
  // layout has no quantized form).
  require(opt.flash_attn || opt.cache_type_v == "f16", "session: a quantized V cache needs flash attention");
  if (!opt.rope.scaling.empty()) {
    const std::string& t = opt.rope.scaling;
    require(t == "none" || t == "linear" || t == "yarn", "session: rope scaling must be none, linear or yarn, got '" + t + "'");
    cp.rope_scaling_type = t == "none" ? LLAMA_ROPE_SCALING_TYPE_NONE : t == "linear" ? LLAMA_ROPE_SCALING_TYPE_LINEAR : LLAMA_ROPE_SCALING_TYPE_YARN;
  }
  require(std::isfinite(opt.rope.freq_base) && opt.rope.freq_base >= 0 && std::isfinite(opt.rope.freq_scale) && opt.rope.freq_scale >= 0,
          "session: rope freq_base and freq_scale must be positive (0: the GGUF's)");
  cp.rope_freq_base = opt.rope.freq_base;
  cp.rope_freq_scale = opt.rope.freq_scale;
  cp.yarn_orig_ctx = opt.rope.yarn_orig_ctx;
  cp.kv_unified = true;
  cp.swa_full = false;
  cp.no_perf = true;
  take_llama_errors();
  ctx_ = llama_init_from_model(model.raw(), cp);
  require(ctx_ != nullptr,
          model.info().path + ": llama.cpp could not create a context of " + std::to_string(n_ctx_) + " tokens" + take_llama_errors());
  n_ctx_ = llama_n_ctx(ctx_);
}

Session::~Session() {
  if (ctx_) llama_free(ctx_);
}

void Session::decode(const std::vector<int32_t>& tokens, int32_t pos0, std::vector<float>* all_logits) {
  require(!tokens.empty(), "decode: no tokens");
  require(pos0 >= 0 && uint64_t(pos0) + tokens.size() <= n_ctx_, "decode: positions " + std::to_string(pos0) + ".." +
                                                                     std::to_string(pos0 + int64_t(tokens.size()) - 1) +
                                                                     " do not fit the context of " + std::to_string(n_ctx_) + " tokens");
  const uint32_t nb = std::min<uint32_t>(opt_.n_batch, n_ctx_);
  llama_batch batch = llama_batch_init(int32_t(nb), 0, 1);
  struct Free {
    llama_batch* b;
    ~Free() { llama_batch_free(*b); }
  } free_batch{&batch};
  for (size_t i = 0; i < tokens.size(); i += nb) {
    const size_t n = std::min<size_t>(nb, tokens.size() - i);
    batch.n_tokens = int32_t(n);
    for (size_t j = 0; j < n; ++j) {
      batch.token[j] = tokens[i + j];
      batch.pos[j] = pos0 + int32_t(i + j);
      batch.n_seq_id[j] = 1;
      batch.seq_id[j][0] = 0;
      batch.logits[j] = all_logits != nullptr || (i + j + 1 == tokens.size());
    }
    take_llama_errors();
    int rc = llama_decode(ctx_, batch);
    require(rc == 0, "decode: llama_decode returned " + std::to_string(rc) + take_llama_errors());
    if (all_logits) {
      const size_t nv = model_.info().n_vocab;
      if (i == 0) all_logits->resize(tokens.size() * nv);
      for (size_t j = 0; j < n; ++j) {
        const float* l = llama_get_logits_ith(ctx_, int32_t(j));
        require(l != nullptr, "decode: no logits for token " + std::to_string(i + j));
        std::copy(l, l + nv, all_logits->data() + (i + j) * nv);
      }
    }
  }
  const float* l = llama_get_logits_ith(ctx_, -1);
  require(l != nullptr, "decode: no logits");
  logits_.assign(l, l + model_.info().n_vocab);
}

const float* Session::last_logits() const {
  require(!logits_.empty(), "no logits yet: decode first");
  return logits_.data();
}

int32_t Session::argmax() const {
  const float* l = last_logits();
  return int32_t(std::max_element(l, l + model_.info().n_vocab) - l);
}

std::vector<int32_t> Session::greedy(int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    int32_t t = argmax();
    out.push_back(t);
    if (i + 1 < n) decode({t}, pos_max() + 1);
  }
  return out;
}

int32_t Session::pos_max() const {
  return llama_memory_seq_pos_max(llama_get_memory(ctx_), 0);
}

void Session::clear() {
  llama_memory_clear(llama_get_memory(ctx_), true);
  logits_.clear();
}

void Session::remove_from(int32_t pos) {
  require(llama_memory_seq_rm(llama_get_memory(ctx_), 0, pos, -1), "remove_from: llama.cpp refused to remove positions >= " + std::to_string(pos));
  logits_.clear();
}

std::vector<uint8_t> Session::seq_state() const {
  size_t n = llama_state_seq_get_size(ctx_, 0);
  require(n > 0, "state: llama_state_seq_get_size failed" + take_llama_errors());
  std::vector<uint8_t> blob(n);
  size_t w = llama_state_seq_get_data(ctx_, blob.data(), blob.size(), 0);
  require(w == n, "state: llama_state_seq_get_data wrote " + std::to_string(w) + " of " + std::to_string(n) + " bytes" + take_llama_errors());
  return blob;
}

void Session::set_seq_state(const std::vector<uint8_t>& blob) {
  take_llama_errors();
  size_t r = llama_state_seq_set_data(ctx_, blob.data(), blob.size(), 0);
  require(r != 0, "restore: llama_state_seq_set_data rejected the state" + take_llama_errors());
  require(r == blob.size(), "restore: llama.cpp read " + std::to_string(r) + " of " + std::to_string(blob.size()) + " bytes of the state");
  logits_.clear();
}

std::map<std::string, std::string> Session::capture_metadata() const {
  const ModelInfo& mi = model_.info();
  std::string ff = "[";
  for (size_t i = 0; i < mi.rope_freq_factors.size(); ++i) ff += (i ? "," : "") + fmt_g9(mi.rope_freq_factors[i]);
  ff += "]";
  return {
      {"arch", mi.arch},
      {"model_name", mi.name},
      {"model_desc", mi.desc},
      {"model_file", std::filesystem::path(mi.path).filename().string()},
      {"model_sha256", model_.sha256()},
      {"llama_cpp_commit", kLlamaCppCommit},
      {"kvtc_version", KVTC_VERSION},
      {"n_ctx", std::to_string(n_ctx_)},
      {"n_ctx_train", std::to_string(mi.n_ctx_train)},
      {"cache_type", "f16"},
      {"flash_attn", opt_.flash_attn ? "enabled" : "disabled"},
      {"v_trans", std::to_string(v_trans())},
      {"n_layer", std::to_string(mi.n_layer)},
      {"n_head_kv", std::to_string(mi.n_head_kv)},
      {"head_dim", std::to_string(mi.head_dim_k)},
      {"rope_type", mi.rope_type},
      {"n_rot", std::to_string(mi.n_rot)},
      {"rope_freq_base", fmt_g9(mi.rope_freq_base)},
      {"rope_freq_scale", fmt_g9(mi.rope_freq_scale)},
      {"rope_scaling_type", mi.rope_scaling_type.empty() ? "none" : mi.rope_scaling_type},
      {"rope_scaling_factor", fmt_g9(mi.rope_scaling_factor)},
      {"rope_scaling_orig_ctx", std::to_string(mi.rope_scaling_orig_ctx)},
      {"rope_freq_factors", ff},
      {"n_swa", std::to_string(mi.n_swa)},
      {"rope_freq_base_swa", fmt_g9(mi.n_swa ? mi.rope_freq_base_swa : 0.0)},
      {"rope_freq_scale_swa", fmt_g9(mi.n_swa ? mi.rope_freq_scale_swa : 0.0)},
  };
}

CacheGeometry Session::geometry() const {
  return geometry_with_settings(model_.geometry(), context_kv_settings(ctx_));
}

KvCapture Session::capture() const {
  std::vector<uint8_t> blob = seq_state();
  KvCapture c = capture_from_state(blob, geometry(), "sequence state");
  c.meta = capture_metadata();
  return c;
}

void Session::restore(const KvCapture& c) {
  const CacheGeometry g = model_.geometry();
  require(c.blocks.size() == g.blocks.size(), "restore: the capture has " + std::to_string(c.blocks.size()) + " cache block(s), " +
                                                  model_.info().path + " has " + std::to_string(g.blocks.size()) + " (capture of another model?)");
  for (size_t bi = 0; bi < c.blocks.size(); ++bi) {
    const KvBlock& b = c.blocks[bi];
    const BlockGeometry& mg = g.blocks[bi];
    require(b.layers == mg.layers && b.n_head_kv == mg.n_head_kv && b.head_dim == mg.head_dim,
            "restore: capture block " + std::to_string(bi) + " has " + std::to_string(b.n_layer()) + " layers x " + std::to_string(b.n_head_kv) +
                " KV heads x " + std::to_string(b.head_dim) + " dims; " + model_.info().path + " needs " + std::to_string(mg.n_layer()) + " x " +
                std::to_string(mg.n_head_kv) + " x " + std::to_string(mg.head_dim) + " (capture of another model?)");
    require(b.k.size() == b.numel() && b.v.size() == b.numel(), "restore: capture block " + std::to_string(bi) + " K/V size differs from its shape");
    // llama.cpp asserts (aborts) on some inconsistent positions; refuse them here.
    std::vector<int32_t> sorted = b.pos;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) {
      require(sorted[i] >= 0 && uint32_t(sorted[i]) < n_ctx_,
              "restore: capture position " + std::to_string(sorted[i]) + " is outside the context of " + std::to_string(n_ctx_) + " tokens");
      require(i == 0 || sorted[i] != sorted[i - 1],
              "restore: capture position " + std::to_string(sorted[i]) + " appears twice in block " + std::to_string(bi));
    }
  }
  require(c.blocks[0].n_tokens() <= n_ctx_,
          "restore: the capture holds " + std::to_string(c.blocks[0].n_tokens()) + " tokens, the context only " + std::to_string(n_ctx_));
  clear();
  const StateLayout to = state_layout(seq_state(), v_trans(), 0, "empty sequence state");
  set_seq_state(state_from_capture(c, to));
}

}  // namespace kvtc
