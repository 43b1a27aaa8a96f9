// What the C++ core knows and records per op: its class, received from the op table (runtime/) by base name
// (native or host fallback, exact data movement, host index tensors allowed), how often it ran natively or as a
// host fallback, its dtype-rule events, and the once-per-op warnings. torchneuron.get_executed_ops(),
// get_fallback_ops() and get_dtype_events() read the counters.
#include <array>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "op_tracking.h"
#include "runtime.h"

namespace torchneuron {
namespace {

// Guards the maps and the table's sets; the entries' counters and flags are atomics (runtime.h).
std::mutex g_mu;
// By schema address, which a new operator may take once a torch.library that defined another is deleted: op_entry
// checks the name. Entries are never freed (a queued kernel or another thread's cache may still point at one).
std::unordered_map<const c10::FunctionSchema*, OpEntry*> g_ops;
std::unordered_set<std::string> g_native, g_exact, g_host_tensors, g_indices, g_overwrites,
    g_recurrent;                                      // base names: "add"
std::unordered_set<std::string> g_structured;         // "mm.default", "sum.dim_IntList"
std::unordered_map<std::string, int64_t> g_explicit;  // ops run by explicit kernels
std::unordered_map<std::string, OpEntry> g_outside;   // device results computed outside the fallback (collectives)
// Entries are never erased: op calls hold references to them without the lock.
OpEntry g_copy_in("aten::copy_ (host to neuron)");

void classify(OpEntry& e) {  // g_mu held
  const std::string b = base_name(e.name);
  e.native.store(g_native.count(b) > 0, std::memory_order_relaxed);
  e.exact.store(g_exact.count(b) > 0, std::memory_order_relaxed);
  e.host_tensors.store(g_host_tensors.count(b) > 0, std::memory_order_relaxed);
  e.indices.store(g_indices.count(b) > 0, std::memory_order_relaxed);
  e.overwrites.store(g_overwrites.count(b) > 0, std::memory_order_relaxed);
  e.recurrent.store(g_recurrent.count(b) > 0, std::memory_order_relaxed);
  e.structured.store(g_structured.count(b + "." + (e.overload.empty() ? "default" : e.overload)) > 0,
                     std::memory_order_relaxed);
}

bool is_type(const c10::TypePtr& t, c10::TypeKind k) {
  if (t->kind() == k) return true;
  auto opt = t->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == k;
}

const OpEntry& entry(const OpEntry& e) { return e; }
const OpEntry& entry(const OpEntry* e) { return *e; }

// Sums a counter over entries of one name (the overloads of an op).
template <class Entries, class Counter>
void add_counts(std::unordered_map<std::string, int64_t>& agg, const Entries& entries, Counter counter) {
  for (const auto& [key, e] : entries)
    if (int64_t n = (entry(e).*counter).load(std::memory_order_relaxed)) agg[entry(e).name] += n;
}

void reset(OpEntry& e) {
  e.executed = e.fallback = e.dtype_events = e.queued = e.waited = e.copied = 0;
  e.warned_fallback = e.warned_fp64 = e.warned_int64 = false;
}

}  // namespace

std::string base_name(const std::string& name) {
  auto pos = name.rfind("::");
  std::string s = pos == std::string::npos ? name : name.substr(pos + 2);
  s = s.substr(0, s.find('.'));                                                 // overload
  if (s.size() > 1 && s.back() == '_' && s[s.size() - 2] != '_') s.pop_back();  // in-place variant
  return s;
}

void set_op_table(const std::vector<std::string>& native, const std::vector<std::string>& exact,
                  const std::vector<std::string>& host_tensors, const std::vector<std::string>& indices,
                  const std::vector<std::string>& overwrites, const std::vector<std::string>& recurrent,
                  const std::vector<std::string>& structured) {
  std::lock_guard<std::mutex> g(g_mu);
  g_native = {native.begin(), native.end()};
  g_exact = {exact.begin(), exact.end()};
  g_host_tensors = {host_tensors.begin(), host_tensors.end()};
  g_indices = {indices.begin(), indices.end()};
  g_overwrites = {overwrites.begin(), overwrites.end()};
  g_recurrent = {recurrent.begin(), recurrent.end()};
  g_structured = {structured.begin(), structured.end()};
  for (auto& [schema, e] : g_ops) classify(*e);
}

OpClass op_class(const std::string& name) {
  std::string b = base_name(name);
  std::lock_guard<std::mutex> g(g_mu);
  bool native = g_native.count(b) > 0, exact = g_exact.count(b) > 0, host = g_host_tensors.count(b) > 0;
  return {std::move(b), native, exact, host};
}

OpEntry& op_entry(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  auto same_op = [&](const OpEntry* e) { return e->name == schema.name() && e->overload == schema.overload_name(); };
  thread_local std::unordered_map<const c10::FunctionSchema*, OpEntry*> seen;  // no lock on the op path
  if (auto it = seen.find(&schema); it != seen.end() && same_op(it->second)) return *it->second;
  std::lock_guard<std::mutex> g(g_mu);
  OpEntry*& slot = g_ops[&schema];
  const bool fresh = !slot || !same_op(slot);
  if (fresh) slot = new OpEntry(schema.name(), schema.overload_name());
  OpEntry& e = *slot;
  seen[&schema] = &e;
  if (!fresh) return e;
  classify(e);
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (is_type(args[i].type(), c10::TypeKind::GeneratorType)) e.generators.push_back(i);
    if (args[i].alias_info() && args[i].alias_info()->isWrite()) e.writes.push_back(i);
    if (is_type(args[i].type(), c10::TypeKind::NumberType)) e.scalars.push_back(i);
  }
  return e;
}

void count_call(OpEntry& e) {
  if (e.native.load(std::memory_order_relaxed)) {
    e.executed.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  e.fallback.fetch_add(1, std::memory_order_relaxed);
  const FallbackPolicy policy = fallback_policy();
  TORCH_CHECK_NOT_IMPLEMENTED(policy != FallbackPolicy::error, "neuron: ", e.name,
                              " is not a native neuron op and TORCHNEURON_FALLBACK=error forbids running it as a "
                              "host fallback (set TORCHNEURON_FALLBACK=warn to allow it)");
  if (policy == FallbackPolicy::warn && !e.warned_fallback.exchange(true, std::memory_order_relaxed))
    TORCH_WARN("neuron: ", e.name,
               " is not a native neuron op; it runs as a host (CPU) fallback. "
               "torchneuron.get_fallback_ops() lists them; TORCHNEURON_FALLBACK=silent|error changes this.");
}

void note_executed(const char* name) {
  std::lock_guard<std::mutex> g(g_mu);
  g_explicit[name]++;
}

void note_fp64(OpEntry& e, Fp64Event event) {
  e.dtype_events.fetch_add(1, std::memory_order_relaxed);
  if (e.warned_fp64.exchange(true, std::memory_order_relaxed)) return;
  switch (event) {
    case Fp64Event::produced:
      TORCH_WARN("neuron: ", e.name,
                 " produced float64 values; Trainium has no fp64, so they carry float32 "
                 "precision (rounded to the nearest float32). TORCHNEURON_DTYPE_POLICY=host keeps full precision.");
      break;
    case Fp64Event::received:
      TORCH_WARN("neuron: ", e.name,
                 " received float64 host values (a Python number or CPU tensor); Trainium has "
                 "no fp64, so they carry float32 precision (rounded to the nearest float32). "
                 "TORCHNEURON_DTYPE_POLICY=host keeps full precision.");
      break;
    case Fp64Event::copied:
      TORCH_WARN(
          "neuron: float64 data copied to the device carries float32 precision (Trainium has no fp64); "
          "TORCHNEURON_DTYPE_POLICY=host keeps full precision.");
      break;
  }
}

namespace {
void warn_int64(const OpEntry& e, const Int64Range& r) {
  TORCH_WARN("neuron: ", e.name, " produced int64 values outside the int32 range [", r.lo, ", ", r.hi,
             "]; Trainium computes int64 as 32-bit, so real hardware would wrap them "
             "(values are kept exact here; TORCHNEURON_DTYPE_POLICY=host silences this)");
}
std::atomic<bool> g_deferred{false};
std::mutex g_deferred_mu;
std::vector<std::pair<const OpEntry*, Int64Range>> g_deferred_int64;
}  // namespace

void note_int64(OpEntry& e, const Int64Range& r) {
  if (!r.outside) return;
  e.dtype_events.fetch_add(1, std::memory_order_relaxed);
  if (!e.warned_int64.exchange(true, std::memory_order_relaxed)) warn_int64(e, r);
}

void note_int64_queued(OpEntry& e, const Int64Range& r) {
  if (!r.outside) return;
  e.dtype_events.fetch_add(1, std::memory_order_relaxed);
  if (e.warned_int64.exchange(true, std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> g(g_deferred_mu);
  g_deferred_int64.emplace_back(&e, r);
  g_deferred.store(true, std::memory_order_release);
}

void warn_deferred() {
  if (!g_deferred.load(std::memory_order_acquire)) return;
  std::vector<std::pair<const OpEntry*, Int64Range>> due;
  {
    std::lock_guard<std::mutex> g(g_deferred_mu);
    due.swap(g_deferred_int64);
    g_deferred.store(false, std::memory_order_relaxed);
  }
  for (const auto& [e, r] : due) warn_int64(*e, r);
}

OpEntry& copy_in_entry() { return g_copy_in; }

OpEntry& outside_entry(const std::string& name) {
  std::lock_guard<std::mutex> g(g_mu);
  return g_outside.try_emplace(name, name).first->second;
}

std::vector<std::pair<std::string, int64_t>> executed_ops() {
  std::lock_guard<std::mutex> g(g_mu);
  std::unordered_map<std::string, int64_t> agg(g_explicit.begin(), g_explicit.end());
  add_counts(agg, g_ops, &OpEntry::executed);
  return {agg.begin(), agg.end()};
}

namespace {
// One counter of every op, aggregated by name.
std::vector<std::pair<std::string, int64_t>> op_counts(std::atomic<int64_t> OpEntry::* counter) {
  std::lock_guard<std::mutex> g(g_mu);
  std::unordered_map<std::string, int64_t> agg;
  add_counts(agg, g_ops, counter);
  return {agg.begin(), agg.end()};
}
}  // namespace

std::vector<std::pair<std::string, int64_t>> queued_ops() { return op_counts(&OpEntry::queued); }
std::vector<std::pair<std::string, int64_t>> waiting_ops() { return op_counts(&OpEntry::waited); }
std::vector<std::pair<std::string, int64_t>> copied_ops() { return op_counts(&OpEntry::copied); }
std::vector<std::pair<std::string, int64_t>> fallback_ops() { return op_counts(&OpEntry::fallback); }

std::vector<std::pair<std::string, int64_t>> dtype_events() {
  std::lock_guard<std::mutex> g(g_mu);
  std::unordered_map<std::string, int64_t> agg;
  add_counts(agg, g_ops, &OpEntry::dtype_events);
  add_counts(agg, g_outside, &OpEntry::dtype_events);
  if (int64_t n = g_copy_in.dtype_events.load(std::memory_order_relaxed)) agg[g_copy_in.name] += n;
  return {agg.begin(), agg.end()};
}

namespace {
constexpr std::array<const char*, static_cast<size_t>(Path::count)> kPathNames = {
    "fast", "now", "host", "first_call", "queued_out", "queued_each", "queued_copy", "kernel", "compiled"};
std::array<std::atomic<int64_t>, static_cast<size_t>(Path::count)> g_paths{};
}  // namespace

void count_path(Path p) noexcept { g_paths[static_cast<size_t>(p)].fetch_add(1, std::memory_order_relaxed); }

std::vector<std::pair<std::string, int64_t>> path_counts() {
  std::vector<std::pair<std::string, int64_t>> out;
  for (size_t i = 0; i < kPathNames.size(); ++i) out.emplace_back(kPathNames[i], g_paths[i].load());
  return out;
}

bool count_path_named(const std::string& name) {
  for (size_t i = 0; i < kPathNames.size(); ++i)
    if (name == kPathNames[i]) return count_path(static_cast<Path>(i)), true;
  return false;
}

void clear_op_tracking() {
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& n : g_paths) n = 0;
  g_explicit.clear();
  reset(g_copy_in);
  for (auto& [name, e] : g_outside) reset(e);  // kept, not erased: a running collective may hold a reference
  for (auto& [schema, e] : g_ops) reset(*e);
  clear_fusion_counts();
}

}  // namespace torchneuron
