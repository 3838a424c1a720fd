//===- zopt-fuzz-step.cpp - libFuzzer over generated descriptions ---------===//
//
// A structure-aware companion of zopt-fuzz-description: the input bytes are
// the choices of a small generator of zopt.step descriptions (states with
// random types, placements and rounding; hyperparameters with defaults; a
// random chain of primitives and named rules whose tied operands follow the
// role rule most of the time; a yield). Most generated descriptions verify,
// so the passes and code generators see far more combinations than byte
// mutations of MLIR text reach; about one choice in sixteen is deliberately
// wrong, to exercise the verifier too. ZOPT_FUZZ_PRINT=1 prints each
// generated description (to reproduce a finding: run the target on it).
//
//===----------------------------------------------------------------------===//
#include "FuzzRunner.h"

#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {

enum Kind { Param = 1, Grad, Master, ExpAvg, ExpAvgSq, MaxExpAvgSq, MomentumBuffer };
const char *const kKindNames[] = {"",        "param",      "grad",
                                  "master",  "exp_avg",    "exp_avg_sq",
                                  "max_exp_avg_sq", "momentum_buffer"};
const char *const kHypers[] = {"lr",           "beta1",    "beta2",
                               "eps",          "weight_decay", "momentum",
                               "dampening",    "bias_correction"};

/// An element value: its SSA name, its type in a type list, and the state
/// it is an update of (0: none, Grad: a gradient), as the verifier traces it.
struct Val {
  std::string name, type;
  int role;
};

struct Gen {
  FuzzedDataProvider &f;
  std::string out;
  std::vector<Val> elems;
  std::vector<std::string> hypers;
  int states[8] = {}; // index into elems of each declared state, -1 if none
  std::string stateType[8];
  int next = 0;

  explicit Gen(FuzzedDataProvider &f) : f(f) {
    for (int &s : states)
      s = -1;
  }

  /// About one choice in forty is a deliberately wrong one.
  bool wrong() { return f.ConsumeIntegralInRange<int>(0, 39) == 0; }
  template <typename T> const T &pick(const std::vector<T> &v) {
    return v[f.ConsumeIntegralInRange<size_t>(0, v.size() - 1)];
  }
  const char *pickType(bool allowF16 = true) {
    static const char *const t[] = {"f32", "bf16", "f16"};
    return t[f.ConsumeIntegralInRange<int>(0, allowF16 ? 2 : 1)];
  }
  std::string fresh() { return "%v" + std::to_string(next++); }

  /// The latest value that is an update of `kind` (the state itself if
  /// none; the param if the state is not declared).
  int latestOf(int kind) {
    for (int i = int(elems.size()) - 1; i >= 0; --i)
      if (elems[i].role == kind)
        return i;
    return states[kind] >= 0 ? states[kind] : states[Param];
  }
  /// A tied operand: an update of one of the written states, usually the
  /// right one for the op.
  int tied(std::initializer_list<int> kinds) {
    std::vector<int> have;
    for (int k : kinds)
      if (states[k] >= 0)
        have.push_back(k);
    if (have.empty() || wrong())
      return f.ConsumeIntegralInRange<int>(0, int(elems.size()) - 1);
    return latestOf(pick(have));
  }
  /// Another element operand: usually a gradient.
  int other() {
    if (f.ConsumeIntegralInRange<int>(0, 4) != 0)
      return latestOf(Grad);
    return f.ConsumeIntegralInRange<int>(0, int(elems.size()) - 1);
  }
  std::string hyper() {
    if (hypers.empty() || (wrong() && wrong()))
      return elems[f.ConsumeIntegralInRange<int>(0, int(elems.size()) - 1)].name;
    return pick(hypers);
  }
  /// A number valid as any default and as max_norm, or (rarely) not.
  std::string number() {
    static const double ok[] = {1e-3, 0.5, 0.9, 0.999, 1e-8, 0.01};
    static const double bad[] = {0.0,  -1.0,   1.0,    2.0,
                                 1e300, 65504.0, 1e-300, 1e30};
    double v = wrong() ? bad[f.ConsumeIntegralInRange<int>(0, std::size(bad) - 1)]
                       : ok[f.ConsumeIntegralInRange<int>(0, std::size(ok) - 1)];
    char buf[40];
    std::snprintf(buf, sizeof(buf), "%.6e", v);
    return buf;
  }

  void state(int kind, const std::string &type, const char *place) {
    std::string name = std::string("%") + kKindNames[kind];
    out += "  " + name + " = zopt.state " + kKindNames[kind] + " : " + type +
           " on " + place;
    // Rounding where it applies (bf16 states that are written), else rarely.
    if ((type == "bf16" && kind != Grad && f.ConsumeIntegralInRange<int>(0, 2) == 0) ||
        wrong())
      out += f.ConsumeBool() ? " rounding stochastic" : " rounding nearest_even";
    out += "\n";
    states[kind] = int(elems.size());
    stateType[kind] = type;
    elems.push_back({name, type, kind});
  }

  /// Emits `%r = op operands : types` and records the result.
  void op(const std::string &mnemonic, const std::vector<int> &elemOps,
          const std::vector<std::string> &hyperOps, int role,
          const std::string &attrs = "") {
    std::string r = fresh();
    out += "  " + r + " = zopt." + mnemonic + " ";
    std::string types;
    bool first = true;
    for (int e : elemOps) {
      out += (first ? "" : ", ") + elems[e].name;
      types += (first ? "" : ", ") + elems[e].type;
      first = false;
    }
    for (const std::string &h : hyperOps)
      out += ", " + h;
    out += attrs + " : " + types + "\n";
    elems.push_back({r, "f32", role});
  }

  std::string generate() {
    // Step attributes and placement.
    int mode = f.ConsumeIntegralInRange<int>(0, 2); // cpu, gpu, offload
    const char *user = mode == 0 ? "cpu" : "gpu";
    const char *opt = mode == 1 ? "gpu" : "cpu";
    std::vector<std::string> attrs;
    if (f.ConsumeBool())
      attrs.push_back("zero_stage = " +
                      std::to_string(f.ConsumeIntegralInRange<int>(0, wrong() ? 5 : 3)) +
                      " : i64");
    if (f.ConsumeBool())
      attrs.push_back("align = " +
                      std::to_string(wrong() ? 24 : 1 << f.ConsumeIntegralInRange<int>(0, 10)) +
                      " : i64");
    if (mode != 0 || wrong()) {
      static const std::vector<std::string> archs = {"sm_80", "sm_90", "sm_70",
                                                     "sm_120", "sm_86"};
      attrs.push_back("gpu_arch = \"" + pick(archs) + "\"");
    }
    out = "zopt.step @fuzz";
    if (!attrs.empty()) {
      out += " attributes {";
      for (size_t i = 0; i < attrs.size(); ++i)
        out += (i ? ", " : "") + attrs[i];
      out += "}";
    }
    out += " {\n";

    // States.
    std::string pt = pickType();
    state(Param, pt, user);
    state(Grad, wrong() ? pickType() : pt, user);
    if (pt != "f32" ? f.ConsumeIntegralInRange<int>(0, 2) != 0 : wrong())
      state(Master,
            wrong() ? pickType()
                    : (f.ConsumeIntegralInRange<int>(0, 3) ? "f32" : "bf16"),
            opt);
    int rule = f.ConsumeIntegralInRange<int>(0, 4); // sgd, momentum, adam, amsgrad, lion
    if (rule >= 2 || wrong())
      state(ExpAvg, pickType(), wrong() ? user : opt);
    if (rule == 2 || rule == 3)
      state(ExpAvgSq, pickType(wrong()), opt);
    if (rule == 3 || wrong())
      state(MaxExpAvgSq, pickType(false), opt);
    if (rule == 1 || wrong())
      state(MomentumBuffer, pickType(), opt);

    // Hyperparameters: a few, some with defaults (a few out of range).
    for (const char *h : kHypers) {
      if (f.ConsumeIntegralInRange<int>(0, 3) == 0 && std::string(h) != "lr")
        continue;
      std::string name = std::string("%") + h;
      out += "  " + name + " = zopt.hyper " + h;
      if (f.ConsumeIntegralInRange<int>(0, 3) == 0)
        out += " default " + number();
      out += "\n";
      hypers.push_back(name);
    }

    // The gradient chain, then a random chain of ops.
    if (pt == "f16" ? !wrong() : f.ConsumeIntegralInRange<int>(0, 5) == 0)
      op("unscale", {states[Grad]}, {}, Grad);
    if (f.ConsumeIntegralInRange<int>(0, 2) == 0) {
      std::string r = fresh();
      int g = latestOf(Grad);
      out += "  " + r + " = zopt.clip_by_global_norm " + elems[g].name +
             " max " + number() + " : " + elems[g].type + "\n";
      elems.push_back({r, "f32", Grad});
    }
    int n = f.ConsumeIntegralInRange<int>(1, 14);
    for (int i = 0; i < n && f.remaining_bytes(); ++i) {
      switch (f.ConsumeIntegralInRange<int>(0, 12)) {
      case 0:
        op("l2_decay", {latestOf(Grad), tied({Param, Master})}, {hyper()}, Grad);
        break;
      case 1: {
        int t = tied({ExpAvg, ExpAvgSq, MomentumBuffer});
        op("ema", {t, other()}, {hyper()}, elems[t].role);
        break;
      }
      case 2: {
        int t = tied({ExpAvgSq, ExpAvg});
        op("ema_sq", {t, other()}, {hyper()}, elems[t].role);
        break;
      }
      case 3:
        op("nesterov", {latestOf(Grad), tied({MomentumBuffer, ExpAvg})},
           {hyper()}, Grad);
        break;
      case 4:
      case 5: {
        int t = tied({Param, Master});
        int d = f.ConsumeIntegralInRange<int>(0, int(elems.size()) - 1);
        op("apply", {t, d}, {hyper()}, elems[t].role);
        break;
      }
      case 6: {
        int t = tied({Param, Master});
        op("decoupled_decay", {t}, {hyper(), hyper()}, elems[t].role);
        break;
      }
      case 7: {
        int t = tied({MaxExpAvgSq});
        op("max", {t, tied({ExpAvgSq})}, {}, elems[t].role);
        break;
      }
      case 8:
        op("sign", {f.ConsumeIntegralInRange<int>(0, int(elems.size()) - 1)}, {}, 0);
        break;
      case 9:
        op("adam_direction", {tied({ExpAvg}), tied({MaxExpAvgSq, ExpAvgSq})},
           {hyper(), hyper(), hyper()}, 0);
        break;
      case 10: {
        int t = tied({MomentumBuffer});
        op("momentum", {t, other()}, {hyper(), hyper()}, elems[t].role);
        break;
      }
      case 11: {
        // zopt.adam: its moments must be the states themselves (rule 20).
        if (states[ExpAvg] < 0 || states[ExpAvgSq] < 0)
          break;
        int p = tied({Param, Master});
        std::string r = fresh(), rm = fresh(), rv = fresh();
        int g = other();
        int m = wrong() ? states[ExpAvgSq] : states[ExpAvg];
        int v = states[ExpAvgSq];
        out += "  " + r + ", " + rm + ", " + rv + " = zopt.adam " +
               elems[p].name + ", " + elems[g].name + ", " + elems[m].name +
               ", " + elems[v].name;
        for (int k = 0; k < 5; ++k)
          out += ", " + hyper();
        out += std::string(f.ConsumeBool() ? " {decoupled}" : "") + " : " +
               elems[p].type + ", " + elems[g].type + ", " + elems[m].type +
               ", " + elems[v].type + "\n";
        elems.push_back({r, "f32", elems[p].role});
        elems.push_back({rm, "f32", ExpAvg});
        elems.push_back({rv, "f32", ExpAvgSq});
        break;
      }
      default: { // a direction applied to the param: the usual last step
        int d = f.ConsumeIntegralInRange<int>(0, int(elems.size()) - 1);
        op("sign", {d}, {}, 0);
        int t = tied({Master, Param});
        op("apply", {t, int(elems.size()) - 1}, {hyper()}, elems[t].role);
        break;
      }
      }
    }

    // Every written state gets an update if the chain gave it none.
    for (int k = Param; k <= MomentumBuffer; ++k) {
      if (states[k] < 0 || k == Grad || latestOf(k) != states[k] || wrong())
        continue;
      if (k == Param && states[Master] >= 0)
        continue;
      int g = other();
      switch (k) {
      case Param:
      case Master:
        op("apply", {states[k], g}, {hyper()}, k);
        break;
      case ExpAvg:
        op("ema", {states[k], g}, {hyper()}, k);
        break;
      case ExpAvgSq:
        op("ema_sq", {states[k], g}, {hyper()}, k);
        break;
      case MaxExpAvgSq:
        op("max", {states[k], latestOf(ExpAvgSq)}, {}, k);
        break;
      default:
        op("momentum", {states[k], g}, {hyper(), hyper()}, k);
        break;
      }
    }

    // The yield: each written state receives its latest update; with a
    // master, the param receives the master's.
    std::vector<std::pair<int, int>> stores; // value, state kind
    for (int k = Param; k <= MomentumBuffer; ++k) {
      if (states[k] < 0 || k == Grad)
        continue;
      if (k == Param && states[Master] >= 0)
        continue;
      stores.push_back({latestOf(k), k});
    }
    if (states[Master] >= 0)
      stores.push_back({latestOf(Master), Param});
    if (stores.size() > 1 && wrong())
      std::swap(stores[0].first, stores[1].first);
    std::string vals, targets, vtypes, ttypes;
    for (size_t i = 0; i < stores.size(); ++i) {
      const char *sep = i ? ", " : "";
      vals += sep + elems[stores[i].first].name;
      vtypes += sep + elems[stores[i].first].type;
      targets += sep + std::string("%") + kKindNames[stores[i].second];
      ttypes += sep + stateType[stores[i].second];
    }
    out += "  zopt.yield " + vals + " into " + targets + " : " + vtypes +
           " into " + ttypes + "\n}\n";
    return out;
  }
};

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  FuzzedDataProvider f(data, size);
  std::string text = Gen(f).generate();
  static bool print = std::getenv("ZOPT_FUZZ_PRINT") != nullptr;
  if (print)
    llvm::errs() << text << "// ----\n";
  return zopt_fuzz::runDescription(text);
}
