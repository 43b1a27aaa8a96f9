// Argument signatures: the one key scheme under everything the runtime learns at a first call and replays after, an
// op's result layout (layout.cpp, per call) and a fused run's plan (fusion.cpp, per run). A value writes its Token
// and its data; how a tensor's memory and a number's value enter is the caller's policy (a `Keyer`): the layout memo
// numbers tensors by the earlier argument over the same storage and keys integers by value, a fused run keys memory
// relative to the regions its tensors overlap and keeps numbers as leaves (their values are the kernel's arguments).
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torchneuron {

enum class Token : int64_t {
  undefined_tensor = -1,  // an absent optional tensor
  host_scalar = -2,       // a 0-dim CPU tensor among device arguments (then: dtype, wrapped number)
  tensor = 1,             // a device tensor (then: the Keyer's memory entries, dtype, dim, sizes, strides)
  floating = 2,           // numbers: their kind, then what the Keyer keeps of the value
  integer = 3,
  boolean = 4,
  list = 5,    // then: its length and its elements
  string = 6,  // then: its hash
  none = 7,
  device = 8,  // then: type * 256 + index
  generator = 9,
  complex = 10,
  op = 11,     // a fused run's op (then: its schema's address)
  other = 12,  // a value no signature can key (then: its kind's name length)
};

inline void put(std::vector<int64_t>& key, Token t) { key.push_back(static_cast<int64_t>(t)); }

// The metadata of a tensor that every signature keys: dtype, dim, sizes, strides.
inline void put_tensor_meta(std::vector<int64_t>& key, const at::Tensor& t) {
  key.insert(key.end(), {static_cast<int64_t>(t.scalar_type()), t.dim()});
  key.insert(key.end(), t.sizes().begin(), t.sizes().end());
  key.insert(key.end(), t.strides().begin(), t.strides().end());
}

// A double's bits (-0.0 and NaN are values of their own).
inline int64_t bits_of(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

// Write `v` into `k.key`: the Keyer writes tensors (`bool tensor(const at::Tensor&)`, false: refused) and a number's
// value after its kind (`void number(const c10::IValue&)`). False when `v`, or a value inside it, cannot be keyed.
template <class Keyer>
bool put_value(const c10::IValue& v, Keyer& k) {
  std::vector<int64_t>& key = k.key;
  if (v.isTensor()) return k.tensor(v.toTensor());
  if (v.isDouble() || v.isInt() || v.isBool()) {
    put(key, v.isDouble() ? Token::floating : v.isInt() ? Token::integer : Token::boolean);
    k.number(v);
    return true;
  }
  if (v.isList()) {
    const auto& l = v.toListRef();
    put(key, Token::list), key.push_back(static_cast<int64_t>(l.size()));
    bool keyed = true;  // every element is written even so: a fused run numbers the leaves after it
    for (const c10::IValue& x : l) keyed = put_value(x, k) && keyed;
    return keyed;
  }
  if (v.isString()) {
    put(key, Token::string), key.push_back(static_cast<int64_t>(std::hash<std::string_view>{}(v.toStringView())));
  } else if (v.isNone()) {
    put(key, Token::none);
  } else if (v.isDevice()) {
    put(key, Token::device), key.push_back(static_cast<int64_t>(v.toDevice().type()) * 256 + v.toDevice().index());
  } else if (v.isGenerator()) {
    put(key, Token::generator);
  } else if (v.isComplexDouble()) {
    put(key, Token::complex);
  } else {
    put(key, Token::other), key.push_back(static_cast<int64_t>(v.tagKind().size()));
    return false;
  }
  return true;
}

// The hash of a key (both memos look keys up by it, then compare them whole).
struct FNV1a {  // over the tokens, one at a time (a key's prefixes hash on the way)
  uint64_t h = 1469598103934665603ull;
  void add(int64_t v) { h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull; }
};
inline uint64_t key_hash(const std::vector<int64_t>& key) {
  FNV1a f;
  for (int64_t v : key) f.add(v);
  return f.h;
}
struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const noexcept { return static_cast<size_t>(key_hash(k)); }
};

// What was learnt at the first call of a signature (a result layout, a fused run's plan), bounded in two
// generations: when `map` holds `limit` keys it becomes `old`, and a key found in `old` moves back. The signatures
// in use stay (a loop's shapes recur) and new ones are always learnt: signatures that keep changing (a growing KV
// cache, variable-length batches) never leave the rest to run unlearnt for good. Not locked: its owner locks it.
// `Key` may be a key's hash alone where a collision costs only a wrong guess (fusion.cpp's sightings).
template <class V, class Key = std::vector<int64_t>, class Hash = KeyHash>
struct SignatureMemo {
  using Map = std::unordered_map<Key, V, Hash>;
  explicit SignatureMemo(size_t limit) : limit(limit) {}
  // In the current generation (a read: callers may hold a shared lock).
  const V* recent(const Key& key) const {
    auto it = map.find(key);
    return it == map.end() ? nullptr : &it->second;
  }
  bool aging(const Key& key) const { return old.count(key) != 0; }
  // In either generation, moved back into the current one (a write).
  const V* find(const Key& key) {
    if (const V* v = recent(key)) return v;
    auto it = old.find(key);
    if (it == old.end()) return nullptr;
    V v = std::move(it->second);
    old.erase(it);
    return &put(key, std::move(v));
  }
  V& put(Key key, V v) {
    if (map.size() >= limit && !map.count(key)) old = std::move(map), map = Map();
    return map.insert_or_assign(std::move(key), std::move(v)).first->second;
  }

 private:
  size_t limit;
  Map map, old;
};

}  // namespace torchneuron
