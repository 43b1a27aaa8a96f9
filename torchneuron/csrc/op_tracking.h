// op_tracking.cpp's interface: each op's entry (its class from the op table, its counters) and the execution
// paths launches took.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torchneuron {

struct Int64Range;  // policy.cpp's (runtime.h)

// ---- op_tracking.cpp: how a launch ran: docs/device.md's table of paths, a counter per path
// (torchneuron.get_execution_paths(); the ops a stream worker ran inside fused kernels are counted by fusion.cpp).
enum class Path : uint8_t {
  fast,         // fastpath.cpp: a small structured op on an idle stream, computed at the call
  now,          // a view: metadata only, at the call
  host,         // on the calling thread after the stream's work (results depend on data, CPU index tensors, fp64
                // under the trainium rules, launch-blocking, small work on an idle stream, no argument signature)
  first_call,   // the first call of an argument signature: on the host, its result layout recorded
  queued_out,   // queued: the out= overload writes into the memory handed out at the launch
  queued_each,  // queued: a list op as its per-tensor out= op
  queued_copy,  // queued: the functional kernel, its fresh results copied into the launch's memory
  kernel,       // an explicit kernel through launch() (SDPA, random fills, copies)
  compiled,     // a torch.compile'd graph's kernel (compiler/kernel.py)
  count
};
void count_path(Path p) noexcept;
std::vector<std::pair<std::string, int64_t>> path_counts();  // every path, by name ("first_call": 3)
bool count_path_named(const std::string& name);              // false: no path has that name

// ---- op_tracking.cpp: each op's class (from the op table, runtime/) and what it did ----
// One per operator schema (overloads of one name aggregate in the reports). Counters and flags are atomics: op
// calls on any thread (autograd workers, DataLoader threads) update them with no lock held.
struct OpEntry {
  explicit OpEntry(std::string op_name, std::string overload_name = "")
      : name(std::move(op_name)), overload(std::move(overload_name)) {}
  const std::string name;                           // "aten::add_" (overload dropped)
  const std::string overload;                       // "dim_IntList" ("" for the default overload)
  std::vector<size_t> generators, writes, scalars;  // argument positions (scalars: `Scalar` values); fixed
  // The op table's classification of the base name; _set_op_table may change it while ops run.
  std::atomic<bool> native{false};        // the device runs it (else a counted host fallback)
  std::atomic<bool> exact{false};         // pure data movement: keeps every bit under the trainium dtype policy
  std::atomic<bool> host_tensors{false};  // takes CPU index tensors alongside device ones
  // Its int64 results are positions in its arguments (max_pool's, argmax's, sort's indices): the trainium int64
  // rule need not look at their values when no argument is int64 and none holds 2^31 elements.
  std::atomic<bool> indices{false};
  std::atomic<bool> overwrites{false};  // its in-place form writes its argument whole without reading it (fill_)
  std::atomic<bool> recurrent{false};   // runs a sequence step after step (an RNN layer), splitting one step's work
  // This overload is a structured kernel in ATen (its functional and out= forms run one meta and impl): a queued
  // call runs the out= form into the memory its launch handed out (fallback.cpp's out_variant).
  std::atomic<bool> structured{false};
  std::atomic<int64_t> executed{0}, fallback{0}, dtype_events{0};
  std::atomic<int64_t> queued{0}, waited{0};  // calls queued; calls that made the host wait for the stream
  std::atomic<int64_t> copied{0};  // queued calls whose kernel made its results elsewhere: copied into device memory
  std::atomic<bool> warned_fallback{false}, warned_fp64{false}, warned_int64{false};
  // How the fallback runs it (fallback.cpp, decided at the first call): `now` on the calling thread (views:
  // metadata only), `host` on the calling thread after the stream's queued work (its results depend on data),
  // `queued` on the stream with the result layout of its first call with the same argument signature.
  // sync: on the host, and a sync point (its result is a number or a bool handed to Python, as CUDA's copy back)
  enum class Exec : uint8_t { unknown, now, host, sync, queued };
  std::atomic<uint8_t> exec{0};
  std::atomic<void*> layouts{nullptr};      // fallback.cpp's per-signature result layouts
  std::atomic<void*> out_variant{nullptr};  // fallback.cpp: its out= overload (an OperatorHandle), once looked up
  std::atomic<bool> out_looked_up{false};
  std::atomic<uint8_t> fuses{0};  // fusion.cpp: 0 not asked yet, 1 no, 2 yes
};
// The base name the op table is keyed by: "aten::add_.Tensor" -> "add" (namespace, overload and the in-place
// underscore dropped; dunder names such as "__and__" kept).
std::string base_name(const std::string& name);
// native / exact / host_tensors / indices / overwrites: base names; structured: "name.overload" ("mm.default"). No
// op list lives in C++.
void set_op_table(const std::vector<std::string>& native, const std::vector<std::string>& exact,
                  const std::vector<std::string>& host_tensors, const std::vector<std::string>& indices,
                  const std::vector<std::string>& overwrites, const std::vector<std::string>& recurrent,
                  const std::vector<std::string>& structured);
struct OpClass {
  std::string base;
  bool native, exact, host_tensors;
};
OpClass op_class(const std::string& name);         // qualified name, with or without overload
OpEntry& op_entry(const c10::OperatorHandle& op);  // created and classified on first use; the address is stable
// An op call reached the fallback: count it as native or host fallback and apply the fallback policy (raises
// NotImplementedError under `error`, warns once per op under `warn`).
void count_call(OpEntry& e);
void note_executed(const char* name);                 // an explicit kernel ran on the device
enum class Fp64Event { produced, received, copied };  // an op's result, host values entering an op, a copy in
void note_fp64(OpEntry& e, Fp64Event event);          // counts the event; warns once per op
void note_int64(OpEntry& e, const Int64Range& r);     // counts and warns once per op if `r` leaves int32
// The same from a queued kernel on a stream worker: counted now, warned at the next op some thread launches (a copy to
// the host, `.item()`, included): a warning belongs to the user's thread, inside an op's Python binding, where it
// becomes a UserWarning.
void note_int64_queued(OpEntry& e, const Int64Range& r);
void warn_deferred();                             // the warnings queued kernels left, on this thread
OpEntry& copy_in_entry();                         // host -> device copies
OpEntry& outside_entry(const std::string& name);  // device results computed outside the fallback
// (name, count) pairs
std::vector<std::pair<std::string, int64_t>> executed_ops();
std::vector<std::pair<std::string, int64_t>> fallback_ops();
std::vector<std::pair<std::string, int64_t>> dtype_events();
std::vector<std::pair<std::string, int64_t>> queued_ops();
std::vector<std::pair<std::string, int64_t>> waiting_ops();
std::vector<std::pair<std::string, int64_t>> copied_ops();
void clear_op_tracking();  // also re-arms the warnings (and clears the path counts)

}  // namespace torchneuron
