// Adaptive eager fusion, the device's half: a queued launch of a large functional or in-place op that fuses (the op
// table's `fuse`, asked of compiler/eager_fusion.py once per op) carries a FusableOp; a stream worker that finds
// several of them queued back to back (the host ran ahead) hands the run to eager_fusion.run_queued, which fuses its
// leading ops into one Inductor CPU kernel (compiled once a group recurs) and runs it, or declines. Declined ops run
// one by one as they were queued, so fusion changes speed only. Python is entered holding the GIL, on the worker.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <algorithm>
#include <array>
#include <unordered_map>
#include <vector>

#include "fusion.h"
#include "runtime.h"
#include "signature.h"

namespace torchneuron {
namespace {

PyObject* g_fusable = nullptr;      // eager_fusion.fusable, kept for the process
PyObject* g_run = nullptr;          // eager_fusion.run_queued (verify=True: eager_fusion.plan_of)
std::atomic<bool> g_verify{false};  // replay verification (tests): rebuild each replayed plan in Python and compare
std::atomic<int64_t> g_verified{0}, g_mismatched{0};
std::mutex g_mismatch_mu;
std::string g_last_mismatch;
std::atomic<bool> g_installed{false};
FusionLimits g_limits;  // set before g_installed
std::atomic<int64_t> g_kernels{0}, g_ops{0}, g_cold{0};

bool python_usable() { return Py_IsInitialized() && !_Py_IsFinalizing(); }

std::string qualified_name(const c10::OperatorHandle& op) {
  const auto& n = op.schema().operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

}  // namespace

void set_eager_fusion(PyObject* fusable, PyObject* run, FusionLimits limits) {
  Py_XINCREF(fusable);
  Py_XINCREF(run);
  g_fusable = fusable, g_run = run, g_limits = limits;
  g_installed.store(fusable && run);
}

size_t fusion_max_ops() { return g_installed.load() ? g_limits.max_ops : 0; }

bool fusion_wanted(const c10::OperatorHandle& op, OpEntry& e, int64_t elements, size_t list) {
  if (!g_installed.load(std::memory_order_acquire) || elements < g_limits.min_elements || list > g_limits.max_list)
    return false;
  uint8_t known = e.fuses.load(std::memory_order_relaxed);
  if (known) return known == 2;
  if (!python_usable()) return false;
  bool yes = false;
  {
    pybind11::gil_scoped_acquire gil;
    PyObject* r = PyObject_CallFunction(g_fusable, "s", qualified_name(op).c_str());
    if (r)
      yes = PyObject_IsTrue(r) == 1;
    else
      PyErr_Clear();  // an op eager fusion cannot look up does not fuse
    Py_XDECREF(r);
  }
  e.fuses.store(yes ? 2 : 1);
  return yes;
}

namespace {

// A fused run's Plan (eager_fusion.Plan), kept under the run's signature so that a recurring run (a training step's
// optimizer) is replayed without building its group in Python again: that costs more than the kernel saves.
// Leaves number the tensors and numbers of the ops' arguments, then results, depth first (as eager_fusion does).
struct FusedPlan {
  pybind11::object kernel;
  size_t ops = 0;
  std::vector<int> args;                           // the leaf of each kernel argument: inputs, then outputs
  std::vector<int> lifts;                          // per input: the ScalarType of a lifted scalar, -1 for a tensor
  std::vector<std::pair<int, c10::IValue>> baked;  // number leaves compiled into the kernel, with their values
};
// Read and written holding the GIL; never destroyed (its Python references would be released without the GIL at
// exit). Shared: a replay keeps its plan while another stream's worker, taking the GIL as the kernel runs without
// it, may retire that plan from the memo.
auto& g_plans = *new SignatureMemo<std::shared_ptr<const FusedPlan>>(256);

// The run's signature up to each op: what a plan is valid for. The ops, every constant that is not a number, the
// kinds of the numbers, each tensor's dtype, sizes and strides, and where tensors share memory: eager fusion's
// decisions (one input for one tensor passed twice, a run that ends at a view of a written tensor, a result not
// stored because its block was handed out again) depend on which tensors overlap, not on where memory is. So a
// tensor's addresses enter relative to the memory it overlaps (its storage and the storages overlapping it, taken
// in the order the run first touches them): a training loop's tensors need not come back at the same addresses.
struct Signature {
  struct Memory {
    int64_t begin, end, data;  // its storage's bytes; its first element
    size_t slot;               // where its 3 key entries go
  };
  std::vector<int64_t> key;               // the whole run's; `prefix_key` gives the first ops'
  std::vector<size_t> ends, memory_ends;  // key entries and tensors after each op
  std::vector<Memory> memory;
  std::vector<c10::IValue> leaves;
  // The Keyer of signature.h: a tensor's memory entries are left for `prefix_key`, numbers are leaves.
  bool tensor(const at::Tensor& t) {
    if (!t.defined()) return put(key, Token::undefined_tensor), true;  // None to Python: no leaf
    leaves.emplace_back(t);
    const auto begin = reinterpret_cast<int64_t>(t.storage().data());
    memory.push_back({begin, begin + static_cast<int64_t>(t.storage().nbytes()),
                      reinterpret_cast<int64_t>(t.data_ptr()), key.size()});
    put(key, Token::tensor), key.insert(key.end(), {0, 0, 0});
    put_tensor_meta(key, t);
    return true;
  }
  void number(const c10::IValue& v) { leaves.push_back(v); }
  void add(const c10::IValue& v) { put_value(v, *this); }  // a value no signature keys: Python refuses its op
  void end_op() { ends.push_back(key.size()), memory_ends.push_back(memory.size()); }
  // The hash of each prefix's key without its memory entries ([n]: the first n ops; [0], [1] unused).
  std::vector<uint64_t> shape_hashes() const {
    std::vector<uint64_t> h(ends.size() + 1, 0);
    FNV1a f;
    for (size_t n = 1, i = 0; n <= ends.size(); ++n) {
      for (; i < ends[n - 1]; ++i) f.add(key[i]);
      h[n] = f.h;
    }
    return h;
  }
  // The key of the first n ops: each tensor's memory as (region, storage start and first element relative to the
  // region), regions being the overlapping storages, numbered in the order the run first touches them.
  std::vector<int64_t> prefix_key(size_t n) const {
    std::vector<int64_t> k(key.begin(), key.begin() + static_cast<std::ptrdiff_t>(ends[n - 1]));
    const size_t m = memory_ends[n - 1];
    std::vector<size_t> order(m), region(m);
    for (size_t i = 0; i < m; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return memory[a].begin < memory[b].begin; });
    std::vector<int64_t> start;  // of each region
    int64_t reach = 0;
    for (size_t j = 0; j < m; ++j) {
      const Memory& x = memory[order[j]];
      if (start.empty() || x.begin >= reach)
        start.push_back(x.begin), reach = x.end;
      else
        reach = std::max(reach, x.end);
      region[order[j]] = start.size() - 1;
    }
    std::vector<int64_t> number(start.size(), -1);
    int64_t next = 0;
    for (size_t i = 0; i < m; ++i) {
      const Memory& x = memory[i];
      int64_t& id = number[region[i]];
      if (id < 0) id = next++;
      const int64_t base = start[region[i]];
      k[x.slot + 1] = id, k[x.slot + 2] = x.begin - base, k[x.slot + 3] = x.data - base;
    }
    return k;
  }
};

bool same_number(const c10::IValue& a, const c10::IValue& b) {
  if (a.isDouble() && b.isDouble())  // bit for bit: -0.0 and NaN compile to other code than 0.0 and a number
    return bits_of(a.toDouble()) == bits_of(b.toDouble());
  if (a.isInt() && b.isInt()) return a.toInt() == b.toInt();
  return a.isBool() && b.isBool() && a.toBool() == b.toBool();
}

// Lifted numbers enter a kernel as 0-d tensors. An optimizer's list ops lift several per parameter (1,036 for the
// AdamW step of a 148-tensor GPT-2): made afresh at each replay they cost more than the kernel, and their Python
// objects set off the garbage collector every step. So each worker keeps its own, by dtype, and a replay writes its
// numbers into them (a kernel reads its arguments during the call only; a worker runs one replay at a time).
class LiftedScalars {
 public:
  at::Tensor next(at::ScalarType dtype, const c10::Scalar& v) {
    auto& pool = pools_[static_cast<size_t>(dtype)];
    size_t& k = used_[static_cast<size_t>(dtype)];
    if (k == pool.size()) pool.push_back(at::empty({}, at::TensorOptions().dtype(dtype)));
    at::Tensor t = pool[k++];
    AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(at::kHalf, at::kBFloat16, at::kBool, dtype, "lifted scalar",
                                           [&] { *t.mutable_data_ptr<scalar_t>() = v.to<scalar_t>(); });
    return t;
  }
  void rewind() { used_.fill(0); }

 private:
  static constexpr size_t kDtypes = static_cast<size_t>(at::ScalarType::NumOptions);
  std::array<std::vector<at::Tensor>, kDtypes> pools_;
  std::array<size_t, kDtypes> used_{};
};

// Run `p` on this run's leaves (holding the GIL); false if it does not apply (a baked number differs).
bool replay(const FusedPlan& p, const Signature& s) {
  for (const auto& [leaf, v] : p.baked)
    if (!same_number(s.leaves[leaf], v)) return false;
  thread_local LiftedScalars scalars;
  scalars.rewind();
  const size_t n_in = p.lifts.size();
  pybind11::list inputs(n_in), outs(p.args.size() - n_in);
  for (size_t j = 0; j < p.args.size(); ++j) {
    const c10::IValue& leaf = s.leaves[p.args[j]];
    at::Tensor t = j < n_in && p.lifts[j] >= 0 ? scalars.next(static_cast<at::ScalarType>(p.lifts[j]), leaf.toScalar())
                                               : leaf.toTensor();
    pybind11::object o = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(std::move(t)));
    if (j < n_in)
      inputs[j] = o;
    else
      outs[j - n_in] = o;
  }
  p.kernel(inputs, outs);
  return true;
}

// The queued ops as eager_fusion sees them: (qualified name, args, outs) each.
pybind11::list python_group(c10::ArrayRef<const FusableOp*> ops) {
  pybind11::list group;
  for (const FusableOp* f : ops) {
    pybind11::list args, outs;
    for (const c10::IValue& v : f->args) args.append(torch::jit::toPyObject(v));
    for (const at::Tensor& o : f->outs) outs.append(torch::jit::toPyObject(o));
    group.append(pybind11::make_tuple(qualified_name(f->op), args, outs));
  }
  return group;
}

// Replay verification: the plan the group builder makes for `ops` (the ops the plan covered) now must be the replayed
// one (the C++ signature must capture everything the builder decides on). A difference is counted and described,
// never raised. (Given the ops after them too, the builder may pick a longer group whose kernel is not compiled yet.)
void verify_replay(c10::ArrayRef<const FusableOp*> ops, const FusedPlan& p) {
  auto r = pybind11::reinterpret_borrow<pybind11::object>(g_run)(python_group(ops), true).cast<pybind11::tuple>();
  std::string why;
  const auto n = r[0].cast<int64_t>();
  if (n != static_cast<int64_t>(p.ops) || r[1].is_none()) {
    why = "the builder fuses " + std::to_string(n) + " ops, the replayed plan " + std::to_string(p.ops);
  } else {
    pybind11::handle plan = r[1];
    std::vector<int> lifts;
    for (pybind11::handle d : plan.attr("lifts"))
      lifts.push_back(d.is_none() ? -1 : static_cast<int>(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type));
    if (plan.attr("kernel").ptr() != p.kernel.ptr())
      why = "another kernel";
    else if (plan.attr("args").cast<std::vector<int>>() != p.args)
      why = "other argument leaves";
    else if (lifts != p.lifts)
      why = "other lifted scalars";
    else if (pybind11::len(plan.attr("baked")) != p.baked.size())
      why = "other baked numbers";
  }
  g_verified.fetch_add(1);
  if (why.empty()) return;
  g_mismatched.fetch_add(1);
  std::lock_guard<std::mutex> g(g_mismatch_mu);
  g_last_mismatch = why;
}

void keep(const Signature& s, pybind11::handle plan) {
  FusedPlan p;
  p.kernel = plan.attr("kernel");
  p.ops = plan.attr("ops").cast<size_t>();
  if (p.ops < 2 || p.ops > s.ends.size()) return;
  p.args = plan.attr("args").cast<std::vector<int>>();
  for (pybind11::handle d : plan.attr("lifts"))
    p.lifts.push_back(d.is_none() ? -1 : static_cast<int>(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type));
  for (pybind11::handle b : plan.attr("baked")) {
    auto pair = b.cast<pybind11::tuple>();
    PyObject* v = pair[1].ptr();
    c10::IValue value = PyBool_Check(v)   ? c10::IValue(v == Py_True)
                        : PyLong_Check(v) ? c10::IValue(pair[1].cast<int64_t>())
                                          : c10::IValue(pair[1].cast<double>());
    p.baked.emplace_back(pair[0].cast<int>(), std::move(value));
  }
  for (int a : p.args)
    if (a < 0 || static_cast<size_t>(a) >= s.leaves.size()) return;
  g_plans.put(s.prefix_key(p.ops), std::make_shared<const FusedPlan>(std::move(p)));
}

// The sightings of a run's prefixes (each prefix's key hash), so that the group builder (Python: tens of
// milliseconds for list ops over an HF model's parameters, holding the GIL the host thread needs) runs only for a
// run that recurs. A run's ops depend on how far the host ran ahead of the worker, so a loop that syncs at changing
// points hands over runs that never recur. Read and written holding the GIL (its Python references).
struct Sightings {
  int seen = 0;
  size_t ops = 0;            // the group the builder found in this prefix (0: not built yet: the whole prefix)
  pybind11::object waiting;  // its kernel compiles: ask again once this returns true
  bool never = false;        // its group cannot be compiled (failed, or the compile budget is spent)
};
auto& g_sightings = *new SignatureMemo<Sightings, uint64_t, std::hash<uint64_t>>(1024);

// After the builder answered for the prefix `hash` (how many ops it fused, or what it said instead), remember it.
void note_answer(uint64_t hash, const pybind11::tuple& r) {
  const auto* found = g_sightings.find(hash);
  Sightings x = found ? *found : Sightings{};
  if (r[1].is_none()) {  // no group leads here: the first op runs alone
    x.never = true, x.ops = 1;
  } else if (PyLong_Check(r[1].ptr())) {
    x.ops = r[1].cast<size_t>();
    if (r.size() > 2)
      x.waiting = r[2];
    else
      x.never = true;
  }
  g_sightings.put(hash, std::move(x));
}

}  // namespace

size_t run_fused(c10::ArrayRef<const FusableOp*> ops, std::exception_ptr& error, size_t& unfused) {
  if (!g_installed.load(std::memory_order_relaxed) || !python_usable()) return 0;
  // The run's signature and the key of the whole run (what a recurring run replays under) are made before the GIL is
  // taken: over an optimizer's list ops they take a good part of a replay, and the host thread needs the GIL.
  Signature s;
  std::vector<int64_t> whole;
  try {
    s.key.push_back(at::get_num_threads());  // Inductor splits a kernel's loops for this many threads
    for (const FusableOp* f : ops) {
      put(s.key, Token::op), s.key.push_back(reinterpret_cast<int64_t>(&f->op.schema()));
      for (const c10::IValue& v : f->args) s.add(v);
      for (const at::Tensor& o : f->outs) s.add(c10::IValue(o));
      s.end_op();
    }
    whole = s.prefix_key(ops.size());
  } catch (const std::exception&) {
    return 0;  // a value no signature keys: unfused
  }
  pybind11::gil_scoped_acquire gil;
  size_t ran = 0;
  // The fused kernel itself raised: it may have stored some results already, so its ops must not run again (an
  // in-place op would apply twice): they all fail with its error.
  auto kernel_raised = [&](size_t n, const std::string& what) {
    error = std::make_exception_ptr(
        std::runtime_error("neuron: a fused kernel of " + std::to_string(n) + " ops raised: " + what));
    return n;
  };
  try {
    const bool deterministic = at::globalContext().deterministicAlgorithms();  // fusion is off: Python counts it
    for (size_t n = ops.size(); n >= 2 && !ran && !deterministic; --n) {
      const auto* found = n == ops.size() ? g_plans.find(whole) : g_plans.find(s.prefix_key(n));
      if (found == nullptr || (*found)->ops != n) continue;
      const std::shared_ptr<const FusedPlan> plan = *found;
      try {
        if (replay(*plan, s)) ran = n;
      } catch (pybind11::error_already_set& e) {
        return kernel_raised(n, e.what());
      }
      if (ran && g_verify.load(std::memory_order_relaxed)) verify_replay(ops.slice(0, n), *plan);
    }
    size_t ask = ops.size();       // the ops handed to the group builder
    std::vector<uint64_t> hashes;  // of each prefix, for the sightings
    if (!ran && !deterministic) {
      // the longest prefix seen before decides: still counting, compiling, never, or ask the builder now. Sightings
      // are keyed without the memory entries (as the builder's own key): which blocks the allocator hands a run
      // settles only after a few steps
      hashes = s.shape_hashes();
      size_t lead = 0;
      Sightings before;
      for (size_t n = ops.size(); n >= 2 && !lead; --n)
        if (const auto* x = g_sightings.find(hashes[n])) lead = n, before = *x;
      for (size_t n = 2; n <= ops.size(); ++n) {
        const auto* x = g_sightings.find(hashes[n]);
        Sightings y = x ? *x : Sightings{};
        ++y.seen;
        g_sightings.put(hashes[n], std::move(y));
      }
      bool now = !before.never && before.seen + 1 >= g_limits.after;
      if (now && before.waiting) {
        try {
          now = before.waiting().cast<bool>();
        } catch (const std::exception&) {
          PyErr_Clear();
        }
      }
      if (!now) {
        unfused = lead ? std::clamp<size_t>(before.ops ? before.ops : lead, 1, lead) : ops.size();
        g_cold.fetch_add(1, std::memory_order_relaxed);
        return 0;
      }
      if (lead) ask = lead;
    }
    if (!ran) {
      auto r = pybind11::reinterpret_borrow<pybind11::object>(g_run)(python_group(ops.slice(0, ask)))
                   .cast<pybind11::tuple>();
      const auto n = r[0].cast<int64_t>();
      if (n < 0) return kernel_raised(static_cast<size_t>(-n), r[1].cast<std::string>());
      ran = static_cast<size_t>(n);
      if (ran > 1 && !r[1].is_none()) {
        keep(s, r[1]);
      } else if (ran == 0) {
        if (!deterministic) note_answer(hashes[ask], r);
        if (PyLong_Check(r[1].ptr())) unfused = std::min(r[1].cast<size_t>(), ops.size());  // not compiled yet
      }
    }
  } catch (const std::exception&) {  // run_queued never raises; a conversion that fails means: unfused
    PyErr_Clear();
    return 0;
  }
  if (ran > 1) g_kernels.fetch_add(1, std::memory_order_relaxed), g_ops.fetch_add(ran, std::memory_order_relaxed);
  return ran > 1 ? std::min(ran, ops.size()) : 0;
}

void set_verify_replay(bool on) { g_verify.store(on); }

ReplayChecks replay_checks() {
  std::lock_guard<std::mutex> g(g_mismatch_mu);
  return {g_verified.load(), g_mismatched.load(), g_last_mismatch};
}

FusionCounts fusion_counts() { return {g_kernels.load(), g_ops.load(), g_cold.load()}; }
void clear_fusion_counts() { g_kernels = 0, g_ops = 0, g_cold = 0; }

}  // namespace torchneuron
