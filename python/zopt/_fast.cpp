// zopt._fast: the binding's per-step pass over a part's torch params in C++.
//
// One class, Scan, with the state, the rules and the results of the
// pure-Python zopt._scan.Scan (read that module's docstring: this file
// implements it line for line, reading each tensor through ATen instead of
// Python attributes). One function, same(a, b): the items of two sequences
// are the same objects. Built against one torch (ZOPT_TORCH_VERSION) by
// python/build_fast.py; zopt/_ext.py loads it only under that torch and
// falls back to the Python path otherwise. python/README.md, "The cost of
// step()", says why it exists.
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <tuple>
#include <vector>

#ifndef ZOPT_TORCH_VERSION
#error "build with -DZOPT_TORCH_VERSION=\"<torch.__version__>\" (python/build_fast.py)"
#endif

namespace {

// The interface zopt/_ext.py expects (bumped with any change of Scan's).
constexpr int kInterface = 2;  // 2: forget()

enum : uint8_t { OWN = 0, IN_PLACE = 1, COPIED = 2 };
enum : uint8_t { UNSET = 0, NONE = 1, TENSOR = 2 };  // what `last` is

struct Slot {
  PyObject *param = nullptr;        // strong
  at::Tensor ptensor;               // its tensor (the object's, for its life: p.data = x keeps it)
  c10::TensorImpl *pimpl = nullptr; // ptensor's TensorImpl
  PyObject *reg = nullptr;          // strong: the registered gradient view (or None)
  c10::TensorImpl *reg_impl = nullptr;
  at::Tensor last;                  // p.grad when last seen (kept alive), when seen = TENSOR
  uint8_t seen = UNSET;
  uintptr_t gp = 0;                 // last's data_ptr(); IN_PLACE: what the runtime reads
  uintptr_t own = 0;                // the registered view's address
  uintptr_t pptr = 0;               // the registered param's address
  uintptr_t pb_ptr = 0;             // baseline of the param check
  int64_t pb_ver = 0;
  int64_t numel = 0, gbytes = 0;
  int32_t tid = 0;
  uint8_t mode = OWN, view = 0;
  uint32_t stride_at = 0, ndim = 0;  // into State::strides
};

// A changed gradient: p.grad (undefined: None), its reference taken in the
// first loop while its TensorImpl's line is at hand (the second loop runs
// 10,000 params later); the last gradient is released in the second loop
// (its line fetched ahead in the first, fetch_ahead).
struct New {
  size_t j;
  at::Tensor g;
  uintptr_t ptr;
  uint8_t mode, view;
};

struct State {
  std::vector<Slot> slots;
  std::vector<New> news;  // scratch of sync(), kept to keep its capacity
  std::vector<size_t> copies;
  std::vector<char> changed;
  std::vector<int32_t> mt;
  std::vector<uintptr_t> mp;
  std::vector<int64_t> strides;
  std::vector<uintptr_t> starts, ends;  // the registered params, sorted
  PyObject *active = nullptr;           // bytearray by tensor id (strong)
  bool zero_copy = false, check = false, watch = false, based = false;
  int64_t n_views = 0;
};

struct ScanObject {
  PyObject_HEAD State *s;
};

inline const at::Tensor &tensor_of(PyObject *o) { return THPVariable_Unpack(o); }

inline uintptr_t ptr_of(const at::Tensor &t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); }

bool as_u64(PyObject *o, uintptr_t *out) {
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) return false;
  *out = (uintptr_t)v;
  return true;
}

bool as_i64(PyObject *o, int64_t *out) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) return false;
  *out = (int64_t)v;
  return true;
}

// A sequence of n items (a list or tuple), or a TypeError.
PyObject *seq(PyObject *o, Py_ssize_t n, const char *what) {
  PyObject *f = PySequence_Fast(o, what);
  if (f && n >= 0 && PySequence_Fast_GET_SIZE(f) != n) {
    PyErr_Format(PyExc_ValueError, "Scan: %s has %zd items, not %zd", what, PySequence_Fast_GET_SIZE(f), n);
    Py_DECREF(f);
    return nullptr;
  }
  return f;
}

void clear_state(State *s) {
  for (Slot &x : s->slots) {
    x.ptensor = at::Tensor();  // before the object's last reference may go (no resurrection)
    x.pimpl = nullptr;
    Py_XDECREF(x.param);
    Py_XDECREF(x.reg);
    x.last = at::Tensor();
    x.seen = UNSET;
    x.param = x.reg = nullptr;
  }
  Py_CLEAR(s->active);
}

// ---- construction ------------------------------------------------------------------
int Scan_init(ScanObject *self, PyObject *args, PyObject *kw) {
  static const char *names[] = {"params", "tids", "regs", "own", "pptrs", "numels", "gbytes",
                                "strides", "active", "spans", "zero_copy", "check", "watch",
                                nullptr};
  PyObject *params, *tids, *regs, *own, *pptrs, *numels, *gbytes, *strides, *active, *spans;
  int zero_copy, check, watch;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOppp", const_cast<char **>(names), &params,
                                   &tids, &regs, &own, &pptrs, &numels, &gbytes, &strides, &active,
                                   &spans, &zero_copy, &check, &watch))
    return -1;
  if (!PyByteArray_Check(active)) {
    PyErr_SetString(PyExc_TypeError, "Scan: active must be a bytearray");
    return -1;
  }
  auto s = new State();
  PyObject *lists[8] = {};
  auto fail = [&]() {
    for (PyObject *l : lists) Py_XDECREF(l);
    clear_state(s);
    delete s;
    return -1;
  };
  lists[0] = seq(params, -1, "params");
  if (!lists[0]) return fail();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(lists[0]);
  const char *what[7] = {"tids", "regs", "own", "pptrs", "numels", "gbytes", "strides"};
  PyObject *srcs[7] = {tids, regs, own, pptrs, numels, gbytes, strides};
  for (int i = 0; i < 7; ++i)
    if (!(lists[i + 1] = seq(srcs[i], n, what[i]))) return fail();
  s->slots.resize((size_t)n);
  for (Py_ssize_t j = 0; j < n; ++j) {
    Slot &x = s->slots[(size_t)j];
    PyObject *p = PySequence_Fast_GET_ITEM(lists[0], j);
    if (!THPVariable_Check(p)) {
      PyErr_Format(PyExc_TypeError, "Scan: params[%zd] is not a torch tensor", j);
      return fail();
    }
    Py_INCREF(p);
    x.param = p;
    x.ptensor = tensor_of(p);
    x.pimpl = x.ptensor.unsafeGetTensorImpl();
    PyObject *r = PySequence_Fast_GET_ITEM(lists[2], j);
    Py_INCREF(r);
    x.reg = r;
    if (r != Py_None) {
      if (!THPVariable_Check(r)) {
        PyErr_Format(PyExc_TypeError, "Scan: regs[%zd] is not a torch tensor", j);
        return fail();
      }
      x.reg_impl = tensor_of(r).unsafeGetTensorImpl();
    }
    int64_t tid;
    if (!as_i64(PySequence_Fast_GET_ITEM(lists[1], j), &tid)) return fail();
    if (tid < 0 || tid >= PyByteArray_GET_SIZE(active)) {
      PyErr_Format(PyExc_ValueError, "Scan: tensor id %lld outside the mask", (long long)tid);
      return fail();
    }
    x.tid = (int32_t)tid;
    PyObject *o = PySequence_Fast_GET_ITEM(lists[3], j);
    if (o != Py_None && !as_u64(o, &x.own)) return fail();
    if (!as_u64(PySequence_Fast_GET_ITEM(lists[4], j), &x.pptr)) return fail();
    if (!as_i64(PySequence_Fast_GET_ITEM(lists[5], j), &x.numel)) return fail();
    if (!as_i64(PySequence_Fast_GET_ITEM(lists[6], j), &x.gbytes)) return fail();
    PyObject *st = seq(PySequence_Fast_GET_ITEM(lists[7], j), -1, "a stride");
    if (!st) return fail();
    x.stride_at = (uint32_t)s->strides.size();
    x.ndim = (uint32_t)PySequence_Fast_GET_SIZE(st);
    for (uint32_t d = 0; d < x.ndim; ++d) {
      int64_t v;
      if (!as_i64(PySequence_Fast_GET_ITEM(st, d), &v)) {
        Py_DECREF(st);
        return fail();
      }
      s->strides.push_back(v);
    }
    Py_DECREF(st);
  }
  PyObject *sp = seq(spans, -1, "spans");
  if (!sp) return fail();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(sp); ++i) {
    PyObject *ab = seq(PySequence_Fast_GET_ITEM(sp, i), 2, "a span");
    uintptr_t a = 0, b = 0;
    bool ok = ab && as_u64(PySequence_Fast_GET_ITEM(ab, 0), &a) && as_u64(PySequence_Fast_GET_ITEM(ab, 1), &b);
    Py_XDECREF(ab);
    if (!ok) {
      Py_DECREF(sp);
      return fail();
    }
    s->starts.push_back(a);
    s->ends.push_back(b);
  }
  Py_DECREF(sp);
  for (PyObject *l : lists) Py_XDECREF(l);
  Py_INCREF(active);
  s->active = active;
  s->zero_copy = zero_copy;
  s->check = check;
  s->watch = watch;
  if (self->s) {
    clear_state(self->s);
    delete self->s;
  }
  self->s = s;
  return 0;
}

void Scan_dealloc(ScanObject *self) {
  if (self->s) {
    clear_state(self->s);
    delete self->s;
  }
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject *>(self));
}

State *state_of(ScanObject *self) {
  if (!self->s) PyErr_SetString(PyExc_RuntimeError, "Scan: not initialized");
  return self->s;
}

// ---- rebase ------------------------------------------------------------------------
PyObject *Scan_rebase(ScanObject *self, PyObject *args) {
  PyObject *ptrs, *vers = Py_None;
  if (!PyArg_ParseTuple(args, "O|O", &ptrs, &vers)) return nullptr;
  State *s = state_of(self);
  if (!s) return nullptr;
  Py_ssize_t n = (Py_ssize_t)s->slots.size();
  PyObject *P = seq(ptrs, n, "ptrs");
  if (!P) return nullptr;
  PyObject *V = vers == Py_None ? nullptr : seq(vers, n, "vers");
  if (vers != Py_None && !V) {
    Py_DECREF(P);
    return nullptr;
  }
  std::vector<uintptr_t> pp((size_t)n);
  std::vector<int64_t> vv((size_t)n);
  bool ok = true;
  for (Py_ssize_t j = 0; ok && j < n; ++j) {
    ok = as_u64(PySequence_Fast_GET_ITEM(P, j), &pp[(size_t)j]);
    if (ok && V) ok = as_i64(PySequence_Fast_GET_ITEM(V, j), &vv[(size_t)j]);
  }
  Py_DECREF(P);
  Py_XDECREF(V);
  if (!ok) return nullptr;
  for (size_t j = 0; j < (size_t)n; ++j) {
    s->slots[j].pb_ptr = pp[j];
    s->slots[j].pb_ver = vv[j];
  }
  s->based = true;
  Py_RETURN_NONE;
}

// ---- the pass ----------------------------------------------------------------------
bool over_param(const State *s, uintptr_t a, uintptr_t b) {
  auto it = std::upper_bound(s->starts.begin(), s->starts.end(), a);
  size_t i = (size_t)(it - s->starts.begin());
  if (i > 0 && s->ends[i - 1] > a) return true;
  return i < s->starts.size() && s->starts[i] < b;
}

// zopt._scan.Scan._no_overlaps
void no_overlaps(State *s, std::vector<New> &news, std::vector<char> &changed) {
  std::vector<std::tuple<uintptr_t, uintptr_t, size_t>> spans;
  for (size_t j = 0; j < s->slots.size(); ++j) {
    const Slot &x = s->slots[j];
    if (x.mode == IN_PLACE && x.gbytes && !changed[j]) spans.emplace_back(x.gp, x.gp + (uintptr_t)x.gbytes, j);
  }
  for (const New &n : news)
    if (n.mode == IN_PLACE && s->slots[n.j].gbytes)
      spans.emplace_back(n.ptr, n.ptr + (uintptr_t)s->slots[n.j].gbytes, n.j);
  std::sort(spans.begin(), spans.end());
  std::vector<char> bad(s->slots.size(), 0);
  uintptr_t end = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    auto [a, b, j] = spans[i];
    if ((i && a < end) || (i + 1 < spans.size() && b > std::get<0>(spans[i + 1]))) bad[j] = 1;
    end = i ? std::max(end, b) : b;
  }
  for (New &n : news) {
    const Slot &x = s->slots[n.j];
    if (n.mode == IN_PLACE && x.gbytes &&
        (bad[n.j] || (n.view && over_param(s, n.ptr, n.ptr + (uintptr_t)x.gbytes)))) {
      n.mode = COPIED;
      n.view = 0;
    }
  }
}

PyObject *pack(const std::vector<int32_t> &t, const std::vector<uintptr_t> &p) {
  PyObject *a = PyBytes_FromStringAndSize(reinterpret_cast<const char *>(t.data()),
                                          (Py_ssize_t)(t.size() * sizeof(int32_t)));
  PyObject *b = PyBytes_FromStringAndSize(reinterpret_cast<const char *>(p.data()),
                                          (Py_ssize_t)(p.size() * sizeof(uintptr_t)));
  if (!a || !b) {
    Py_XDECREF(a);
    Py_XDECREF(b);
    return nullptr;
  }
  return Py_BuildValue("(NN)", a, b);
}

PyObject *copies_list(std::vector<size_t> &c) {
  std::sort(c.begin(), c.end());
  PyObject *l = PyList_New((Py_ssize_t)c.size());
  if (!l) return nullptr;
  for (size_t i = 0; i < c.size(); ++i) {
    PyObject *v = PyLong_FromSize_t(c[i]);
    if (!v) {
      Py_DECREF(l);
      return nullptr;
    }
    PyList_SET_ITEM(l, (Py_ssize_t)i, v);
  }
  return l;
}

PyObject *result(PyObject *moved, std::vector<size_t> &copies, bool mask, bool dirty) {
  if (!moved && copies.empty() && !mask && !dirty) Py_RETURN_NONE;
  PyObject *c = nullptr;
  if (!copies.empty()) {
    c = copies_list(copies);
    if (!c) {
      Py_XDECREF(moved);
      return nullptr;
    }
  }
  if (!moved) {
    Py_INCREF(Py_None);
    moved = Py_None;
  }
  if (!c) {
    Py_INCREF(Py_None);
    c = Py_None;
  }
  return Py_BuildValue("(NNOO)", moved, c, mask ? Py_True : Py_False, dirty ? Py_True : Py_False);
}

// The objects sync() reads for param j, fetched ahead in stages (each
// stage's addresses come from what the stage before brought in): the
// param's TensorImpl 16 params ahead, its storage and autograd meta 12
// ahead, the gradient's TensorImpl (and the last one, released later) 8
// ahead, its storage 4 ahead. Reads only what sync() reads anyway.
inline void fetch_lines(const void *p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char *>(p) + o);
}

constexpr size_t kAhead = 4;  // params between two stages

inline void fetch_ahead(const State *s, size_t j, size_t n) {
  const std::vector<Slot> &sl = s->slots;
  // The param's TensorImpl: the lines sync() reads, its head (vtable,
  // storage, autograd meta, version) and tail (offset, numel, dtype, keys),
  // at torch 1.13's offsets; the autograd meta's vtable and grad_. Hints
  // only: other offsets cost speed, never a wrong result.
  if (j + 4 * kAhead < n) {
    const char *i = reinterpret_cast<const char *>(sl[j + 4 * kAhead].pimpl);
    __builtin_prefetch(i);
    __builtin_prefetch(i + 56);
    __builtin_prefetch(i + 160);
    __builtin_prefetch(i + sizeof(c10::TensorImpl) - 1);
  }
  if (j + 3 * kAhead < n) {
    const c10::TensorImpl *i = sl[j + 3 * kAhead].pimpl;
    __builtin_prefetch(i->unsafe_storage().unsafeGetStorageImpl());
    if (const char *m = reinterpret_cast<const char *>(i->autograd_meta())) {
      __builtin_prefetch(m);
      __builtin_prefetch(m + 48);
    }
  }
  if (j + 2 * kAhead < n) {
    const Slot &x = sl[j + 2 * kAhead];
    const c10::TensorImpl *g = x.pimpl->grad().unsafeGetTensorImpl();
    if (g != c10::UndefinedTensorImpl::singleton()) fetch_lines(g, sizeof(c10::TensorImpl));
    if (x.seen == TENSOR && x.last.unsafeGetTensorImpl() != g) __builtin_prefetch(x.last.unsafeGetTensorImpl(), 1);
  }
  if (j + kAhead < n) {
    const c10::TensorImpl *g = sl[j + kAhead].pimpl->grad().unsafeGetTensorImpl();
    if (g != c10::UndefinedTensorImpl::singleton()) __builtin_prefetch(g->unsafe_storage().unsafeGetStorageImpl());
  }
}

PyObject *sync(State *s) {
  const size_t n = s->slots.size();
  bool dirty = false, cand_views = false, any_in_place = false;
  std::vector<New> &news = s->news;
  std::vector<size_t> &copies = s->copies;
  news.clear();
  copies.clear();
  // 1. one pass: what differs from what was last seen, and what each new
  // gradient becomes; nothing changes before all are checked
  for (size_t j = 0; j < n; ++j) {
    fetch_ahead(s, j, n);
    Slot &x = s->slots[j];
    const at::Tensor &P = x.ptensor;
    if (s->check) {
      if (!s->based || ptr_of(P) != x.pb_ptr || (s->watch && P._version() != x.pb_ver)) dirty = true;
    }
    const at::Tensor &g = P.grad();
    if (!g.defined()) {
      if (x.seen != NONE) news.push_back({j, at::Tensor(), 0, OWN, 0});
      continue;
    }
    c10::TensorImpl *gi = g.unsafeGetTensorImpl();
    if (x.seen == TENSOR && gi == x.last.unsafeGetTensorImpl()) {  // (strided: taken before)
      uintptr_t ptr = ptr_of(g);
      if (ptr == x.gp) {
        if (x.mode == COPIED) copies.push_back(j);
        continue;
      }
    } else if (g.layout() != c10::kStrided) {
      news.clear();
      return PyLong_FromSize_t(j);  // refused: the caller names it
    }
    uintptr_t ptr = ptr_of(g);
    if (gi == x.reg_impl) {
      news.push_back({j, g, ptr, OWN, 0});
      continue;
    }
    bool ok = s->zero_copy && ptr != x.pptr;
    if (ok && x.numel > 1) {
      auto st = g.strides();
      ok = st.size() == x.ndim && std::equal(st.begin(), st.end(), s->strides.begin() + x.stride_at);
    }
    if (ok) {
      uint8_t v = g.is_view() ? 1 : 0;
      news.push_back({j, g, ptr, IN_PLACE, v});
      cand_views |= v != 0;
      any_in_place = true;
    } else {
      news.push_back({j, g, ptr, COPIED, 0});
    }
  }
  if (news.empty()) return result(nullptr, copies, false, dirty);
  if (cand_views || (s->n_views && any_in_place)) {
    s->changed.assign(n, 0);
    for (const New &m : news) s->changed[m.j] = 1;
    no_overlaps(s, news, s->changed);
  }
  // 2. applied
  std::vector<int32_t> &mt = s->mt;
  std::vector<uintptr_t> &mp = s->mp;
  mt.clear();
  mp.clear();
  char *act = PyByteArray_AS_STRING(s->active);
  bool mask = false;
  for (New &m : news) {
    Slot &x = s->slots[m.j];
    if (m.mode == IN_PLACE) {
      if (x.mode != IN_PLACE || x.gp != m.ptr) {
        mt.push_back(x.tid);
        mp.push_back(m.ptr);
      }
    } else if (x.mode == IN_PLACE) {  // our own memory again
      mt.push_back(x.tid);
      mp.push_back(x.own);
    }
    if (m.mode == COPIED) copies.push_back(m.j);
    if (x.view != m.view) {
      s->n_views += m.view ? 1 : -1;
      x.view = m.view;
    }
    x.mode = m.mode;
    char on = m.g.defined() ? 1 : 0;
    x.seen = on ? TENSOR : NONE;
    x.last = std::move(m.g);
    x.gp = m.ptr;
    if (act[x.tid] != on) {
      act[x.tid] = on;
      mask = true;
    }
  }
  news.clear();
  PyObject *moved = nullptr;
  if (!mt.empty() && !(moved = pack(mt, mp))) return nullptr;
  return result(moved, copies, mask, dirty);
}

PyObject *Scan_sync(ScanObject *self, PyObject *) {
  State *s = state_of(self);
  if (!s) return nullptr;
  try {
    return sync(s);
  } catch (const std::exception &e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// ---- zero_grad and inspection -----------------------------------------------------
PyObject *Scan_drop(ScanObject *self, PyObject *) {
  State *s = state_of(self);
  if (!s) return nullptr;
  try {
    for (Slot &x : s->slots) {
      if (THPVariable_CheckExact(x.param)) {
        const at::Tensor &P = tensor_of(x.param);
        if (P.grad().defined()) P.mutable_grad().reset();  // torch's `p.grad = None`
      } else if (PyObject_SetAttrString(x.param, "grad", Py_None) < 0) {
        return nullptr;
      }
      x.last = at::Tensor();
      x.seen = UNSET;
    }
  } catch (const std::exception &e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// zopt._scan.Scan.forget: every gradient as never seen (p.grad untouched;
// mode, gp and view stay: the memory handed over is as it was).
PyObject *Scan_forget(ScanObject *self, PyObject *) {
  State *s = state_of(self);
  if (!s) return nullptr;
  for (Slot &x : s->slots) {
    x.last = at::Tensor();
    x.seen = UNSET;
  }
  Py_RETURN_NONE;
}

PyObject *Scan_in_place(ScanObject *self, PyObject *) {
  State *s = state_of(self);
  if (!s) return nullptr;
  PyObject *d = PyDict_New();
  if (!d) return nullptr;
  for (const Slot &x : s->slots) {
    if (x.mode != IN_PLACE) continue;
    PyObject *k = PyLong_FromLong(x.tid), *v = PyLong_FromSize_t(x.gp);
    if (!k || !v || PyDict_SetItem(d, k, v) < 0) {
      Py_XDECREF(k);
      Py_XDECREF(v);
      Py_DECREF(d);
      return nullptr;
    }
    Py_DECREF(k);
    Py_DECREF(v);
  }
  return d;
}

PyMethodDef scan_methods[] = {
    {"sync", (PyCFunction)Scan_sync, METH_NOARGS, "zopt._scan.Scan.sync"},
    {"rebase", (PyCFunction)Scan_rebase, METH_VARARGS, "zopt._scan.Scan.rebase"},
    {"drop", (PyCFunction)Scan_drop, METH_NOARGS, "zopt._scan.Scan.drop"},
    {"forget", (PyCFunction)Scan_forget, METH_NOARGS, "zopt._scan.Scan.forget"},
    {"in_place", (PyCFunction)Scan_in_place, METH_NOARGS, "zopt._scan.Scan.in_place"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject ScanType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ---- same ----------------------------------------------------------------------------
PyObject *same(PyObject *, PyObject *args) {
  PyObject *a, *b;
  if (!PyArg_ParseTuple(args, "OO", &a, &b)) return nullptr;
  PyObject *fa = PySequence_Fast(a, "same: a sequence"), *fb = fa ? PySequence_Fast(b, "same: a sequence") : nullptr;
  if (!fa || !fb) {
    Py_XDECREF(fa);
    return nullptr;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fa);
  bool eq = n == PySequence_Fast_GET_SIZE(fb);
  PyObject **ia = PySequence_Fast_ITEMS(fa), **ib = PySequence_Fast_ITEMS(fb);
  for (Py_ssize_t i = 0; eq && i < n; ++i) eq = ia[i] == ib[i];
  Py_DECREF(fa);
  Py_DECREF(fb);
  return PyBool_FromLong(eq);
}

PyMethodDef module_methods[] = {
    {"same", same, METH_VARARGS, "same(a, b): the two sequences hold the same objects, in order"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_fast",
                          "zopt's per-step pass over the params in C++ (zopt/_fast.cpp)", -1,
                          module_methods};

}  // namespace

PyMODINIT_FUNC PyInit__fast() {
  ScanType.tp_name = "zopt._fast.Scan";
  ScanType.tp_basicsize = sizeof(ScanObject);
  ScanType.tp_flags = Py_TPFLAGS_DEFAULT;
  ScanType.tp_doc = "zopt._scan.Scan in C++";
  ScanType.tp_new = PyType_GenericNew;
  ScanType.tp_init = (initproc)Scan_init;
  ScanType.tp_dealloc = (destructor)Scan_dealloc;
  ScanType.tp_methods = scan_methods;
  if (PyType_Ready(&ScanType) < 0) return nullptr;
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return nullptr;
  Py_INCREF(&ScanType);
  if (PyModule_AddObject(m, "Scan", reinterpret_cast<PyObject *>(&ScanType)) < 0 ||
      PyModule_AddIntConstant(m, "INTERFACE", kInterface) < 0 ||
      PyModule_AddStringConstant(m, "TORCH_VERSION", ZOPT_TORCH_VERSION) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
