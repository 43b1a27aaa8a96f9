// The Python stack that launched a queued kernel, kept for its error (queue.cpp). Taken at every queued launch, so
// it must cost little: the innermost frames' code objects and instruction offsets (a few pointer reads per frame,
// with the GIL the launching thread holds); file names and line numbers are worked out only when an error is
// reported. torch's CapturedTraceback took the whole stack and cost ~9 us per launch, more than the launch itself.
// A code object is released under the GIL: a finished kernel's stack (dropped by the worker, which must not take
// the GIL while the host thread holds it) goes onto a lock-free list that the next launch empties.
#include <Python.h>

#include <array>
#include <atomic>

#include "runtime.h"

namespace torchneuron {
namespace {

constexpr int kShownFrames = 12;  // what an error shows: the innermost frames

struct LaunchStack final : c10::GatheredContext {
  std::array<PyCodeObject*, kShownFrames> code{};
  std::array<int, kShownFrames> lasti{};
  int frames = 0;
  LaunchStack* next = nullptr;  // on the release list
};

std::atomic<LaunchStack*> g_released{nullptr};

void release_later(LaunchStack* s) {  // any thread, GIL or not
  LaunchStack* head = g_released.load(std::memory_order_relaxed);
  do {
    s->next = head;
  } while (!g_released.compare_exchange_weak(head, s, std::memory_order_release, std::memory_order_relaxed));
}

void release_pending() {  // GIL held
  LaunchStack* s = g_released.exchange(nullptr, std::memory_order_acquire);
  while (s) {
    LaunchStack* next = s->next;
    for (int i = 0; i < s->frames; ++i) Py_DECREF(s->code[i]);
    delete s;
    s = next;
  }
}

}  // namespace

std::shared_ptr<c10::GatheredContext> gather_launch_stack() {
  if (!Py_IsInitialized() || !PyGILState_GetThisThreadState()) return nullptr;  // a thread without Python frames
  PyGILState_STATE gil = PyGILState_Ensure();  // held already by a Python caller (cheap); bindings may release it
  release_pending();
  auto* s = new LaunchStack;
  for (PyFrameObject* f = PyEval_GetFrame(); f && s->frames < kShownFrames;) {
    s->code[s->frames] = PyFrame_GetCode(f);  // a new reference
    s->lasti[s->frames++] = PyFrame_GetLasti(f);
    PyFrameObject* back = PyFrame_GetBack(f);  // a new reference; `f` is kept alive by the running call chain
    Py_XDECREF(back);
    f = back;
  }
  PyGILState_Release(gil);
  return std::shared_ptr<c10::GatheredContext>(
      s, [](c10::GatheredContext* c) { release_later(static_cast<LaunchStack*>(c)); });
}

std::string describe_launch_stack(const c10::GatheredContext& stack) {
  const auto* s = dynamic_cast<const LaunchStack*>(&stack);
  if (!s || !s->frames || !Py_IsInitialized()) return "";
  std::string out = " It was launched from (most recent call last):";
  PyGILState_STATE gil = PyGILState_Ensure();
  for (int i = s->frames; i-- > 0;) {
    PyCodeObject* code = s->code[i];
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    const char* name = PyUnicode_AsUTF8(code->co_name);
    out += c10::str("\n  File \"", file ? file : "?", "\", line ", PyCode_Addr2Line(code, s->lasti[i]), ", in ",
                    name ? name : "?");
  }
  PyErr_Clear();
  PyGILState_Release(gil);
  return out;
}

}  // namespace torchneuron
