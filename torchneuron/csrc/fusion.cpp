// Adaptive eager fusion, the device's half: a queued launch of a large functional op that fuses (the op table's
// `fuse`, asked of compiler/eager_fusion.py once per op) carries a FusableOp; a stream worker that finds several
// of them queued back to back (the host ran ahead) hands the run to eager_fusion.run_queued, which fuses its
// leading ops into one Inductor CPU kernel (compiled once a group recurs) and runs it, or declines. Declined ops run
// one by one as they were queued, so fusion changes speed only. Python is entered holding the GIL, on the worker.
#include <ATen/Parallel.h>
#include <Python.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <cstring>
#include <unordered_map>

#include "runtime.h"

namespace torchneuron {
namespace {

PyObject* g_fusable = nullptr;  // eager_fusion.fusable, kept for the process
PyObject* g_run = nullptr;      // eager_fusion.run_queued
std::atomic<bool> g_installed{false};
std::atomic<int64_t> g_kernels{0}, g_ops{0};

bool python_usable() { return Py_IsInitialized() && !_Py_IsFinalizing(); }

std::string qualified_name(const c10::OperatorHandle& op) {
  const auto& n = op.schema().operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

}  // namespace

void set_eager_fusion(PyObject* fusable, PyObject* run) {
  Py_XINCREF(fusable);
  Py_XINCREF(run);
  g_fusable = fusable, g_run = run;
  g_installed.store(fusable && run);
}

bool fusion_wanted(const c10::OperatorHandle& op, OpEntry& e, int64_t elements) {
  if (elements < kFuseElements || !g_installed.load(std::memory_order_relaxed)) return false;
  uint8_t known = e.fuses.load(std::memory_order_relaxed);
  if (known) return known == 2;
  if (!python_usable()) return false;
  bool yes = false;
  {
    pybind11::gil_scoped_acquire gil;
    PyObject* r = PyObject_CallFunction(g_fusable, "s", qualified_name(op).c_str());
    if (r) yes = PyObject_IsTrue(r) == 1;
    else PyErr_Clear();  // an op eager fusion cannot look up does not fuse
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
  std::vector<int64_t> key;
  pybind11::object kernel;
  size_t ops = 0;
  std::vector<int> args;                  // the leaf of each kernel argument: inputs, then outputs
  std::vector<int> lifts;                 // per input: the ScalarType of a lifted scalar, -1 for a tensor
  std::vector<std::pair<int, c10::IValue>> baked;  // number leaves compiled into the kernel, with their values
};
// read and written holding the GIL; never destroyed (its Python references would be released without the GIL at exit)
auto& g_plans = *new std::unordered_map<uint64_t, FusedPlan>();
constexpr size_t kMaxPlans = 256;

// The run's signature up to each op (what a plan is valid for: ops, every tensor's address, layout and storage
// extent, every constant that is not a number, the kinds of the numbers) and its leaves.
struct Signature {
  std::vector<int64_t> key;
  std::vector<size_t> ends;  // key length after each op
  std::vector<c10::IValue> leaves;
  void add(const c10::IValue& v) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) return key.push_back(-1);  // None to Python: no leaf
      leaves.push_back(v);
      key.insert(key.end(), {1, reinterpret_cast<int64_t>(t.data_ptr()), reinterpret_cast<int64_t>(t.storage().data()),
                             static_cast<int64_t>(t.storage().nbytes()), static_cast<int64_t>(t.scalar_type()), t.dim()});
      key.insert(key.end(), t.sizes().begin(), t.sizes().end());
      key.insert(key.end(), t.strides().begin(), t.strides().end());
    } else if (v.isDouble() || v.isInt() || v.isBool()) {
      leaves.push_back(v);
      key.push_back(v.isDouble() ? 2 : v.isInt() ? 3 : 4);
    } else if (v.isList()) {
      auto l = v.toListRef();
      key.insert(key.end(), {5, static_cast<int64_t>(l.size())});
      for (const c10::IValue& x : l) add(x);
    } else if (v.isString()) {
      key.insert(key.end(), {6, static_cast<int64_t>(std::hash<std::string_view>{}(v.toStringView()))});
    } else if (v.isNone()) {
      key.push_back(7);
    } else {
      key.insert(key.end(), {8, static_cast<int64_t>(v.tagKind().size())});  // a device, a generator: never fused
    }
  }
};

uint64_t hash_of(const std::vector<int64_t>& key, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint64_t>(key[i])) * 1099511628211ull;
  return h;
}

bool same_number(const c10::IValue& a, const c10::IValue& b) {
  if (a.isDouble() && b.isDouble()) {  // bit for bit: -0.0 and NaN compile to other code than 0.0 and a number
    double x = a.toDouble(), y = b.toDouble();
    return std::memcmp(&x, &y, sizeof x) == 0;
  }
  if (a.isInt() && b.isInt()) return a.toInt() == b.toInt();
  return a.isBool() && b.isBool() && a.toBool() == b.toBool();
}

// Run `p` on this run's leaves (holding the GIL); false if it does not apply (a baked number differs).
bool replay(const FusedPlan& p, const Signature& s) {
  for (const auto& [leaf, v] : p.baked)
    if (!same_number(s.leaves[leaf], v)) return false;
  const size_t n_in = p.lifts.size();
  pybind11::list inputs(n_in), outs(p.args.size() - n_in);
  for (size_t j = 0; j < p.args.size(); ++j) {
    const c10::IValue& leaf = s.leaves[p.args[j]];
    at::Tensor t = j < n_in && p.lifts[j] >= 0
                       ? at::scalar_tensor(leaf.toScalar(), at::TensorOptions().dtype(static_cast<at::ScalarType>(p.lifts[j])))
                       : leaf.toTensor();
    pybind11::object o = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(std::move(t)));
    if (j < n_in) inputs[j] = o;
    else outs[j - n_in] = o;
  }
  p.kernel(inputs, outs);
  return true;
}

void keep(const Signature& s, pybind11::handle plan) {
  FusedPlan p;
  p.kernel = plan.attr("kernel");
  p.ops = plan.attr("ops").cast<size_t>();
  if (p.ops < 2 || p.ops > s.ends.size()) return;
  p.key.assign(s.key.begin(), s.key.begin() + static_cast<std::ptrdiff_t>(s.ends[p.ops - 1]));
  p.args = plan.attr("args").cast<std::vector<int>>();
  for (pybind11::handle d : plan.attr("lifts"))
    p.lifts.push_back(d.is_none() ? -1 : static_cast<int>(reinterpret_cast<THPDtype*>(d.ptr())->scalar_type));
  for (pybind11::handle b : plan.attr("baked")) {
    auto pair = b.cast<pybind11::tuple>();
    PyObject* v = pair[1].ptr();
    c10::IValue value = PyBool_Check(v) ? c10::IValue(v == Py_True)
                        : PyLong_Check(v) ? c10::IValue(pair[1].cast<int64_t>()) : c10::IValue(pair[1].cast<double>());
    p.baked.emplace_back(pair[0].cast<int>(), std::move(value));
  }
  for (int a : p.args)
    if (a < 0 || static_cast<size_t>(a) >= s.leaves.size()) return;
  if (g_plans.size() >= kMaxPlans) g_plans.clear();
  uint64_t h = hash_of(p.key, p.key.size());
  g_plans[h] = std::move(p);
}

}  // namespace

size_t run_fused(c10::ArrayRef<const FusableOp*> ops) {
  if (!g_installed.load(std::memory_order_relaxed) || !python_usable()) return 0;
  pybind11::gil_scoped_acquire gil;
  size_t ran = 0;
  try {
    Signature s;
    s.key.push_back(at::get_num_threads());  // Inductor splits a kernel's loops for this many threads
    for (const FusableOp* f : ops) {
      s.key.insert(s.key.end(), {9, reinterpret_cast<int64_t>(&f->op.schema())});
      for (const c10::IValue& v : f->args) s.add(v);
      for (const at::Tensor& o : f->outs) s.add(c10::IValue(o));
      s.ends.push_back(s.key.size());
    }
    if (!at::globalContext().deterministicAlgorithms())  // fusion is off then: eager_fusion says so and counts it
      for (size_t n = ops.size(); n >= 2 && !ran; --n) {
        auto it = g_plans.find(hash_of(s.key, s.ends[n - 1]));
        if (it == g_plans.end() || it->second.ops != n || it->second.key.size() != s.ends[n - 1] ||
            !std::equal(it->second.key.begin(), it->second.key.end(), s.key.begin()))
          continue;
        if (replay(it->second, s)) ran = n;
      }
    if (!ran) {
      pybind11::list group;
      for (const FusableOp* f : ops) {
        pybind11::list args, outs;
        for (const c10::IValue& v : f->args) args.append(torch::jit::toPyObject(v));
        for (const at::Tensor& o : f->outs) outs.append(torch::jit::toPyObject(o));
        group.append(pybind11::make_tuple(qualified_name(f->op), args, outs));
      }
      auto r = pybind11::reinterpret_borrow<pybind11::object>(g_run)(group).cast<pybind11::tuple>();
      ran = r[0].cast<size_t>();
      if (ran > 1 && !r[1].is_none()) keep(s, r[1]);
    }
  } catch (const std::exception&) {  // run_queued never raises; a conversion that fails means: unfused
    PyErr_Clear();
    return 0;
  }
  if (ran > 1) g_kernels.fetch_add(1, std::memory_order_relaxed), g_ops.fetch_add(ran, std::memory_order_relaxed);
  return ran > 1 ? std::min(ran, ops.size()) : 0;
}

FusionCounts fusion_counts() { return {g_kernels.load(), g_ops.load()}; }
void clear_fusion_counts() { g_kernels = 0, g_ops = 0; }

}  // namespace torchneuron
