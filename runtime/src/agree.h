// agree.h - what the ranks agree on, and the message naming what differs.
//
// At finalize every rank must have built the same optimizer (step, bucket
// size, groups, tensors, params) and at every step it must use the same
// settings (hyperparameters, step counts, seed, divisor, loss scale,
// max_norm): a rank that disagrees would run other collectives or drift
// apart. The checks exchange the settings (a hash where they are long) and
// name every setting that differs with each rank's value, e.g.
//   "group 0 lr: rank 0 has 0.001, rank 1 has 0.5"
// so that a user can tell which line of which rank's script differs.
#ifndef ZOPT_RUNTIME_AGREE_H
#define ZOPT_RUNTIME_AGREE_H

#include "internal.h"

#include <string>
#include <vector>

namespace zopt {

// A list of named values, each one or more 8-byte words: every rank builds
// it in the same order, so the words line up across ranks.
class Settings {
 public:
  enum Kind { INT, REAL, BOOL, HEX, TEXT, CLIP };
  void add_int(std::string name, int64_t v);
  void add_real(std::string name, double v);
  void add_bool(std::string name, bool v);
  void add_hex(std::string name, uint64_t v);
  void add_text(std::string name, const char *s, int words);  // up to 8*words-1 chars
  void add_clip(std::string name, double max_norm);  // 0: "off"
  const std::vector<uint64_t> &words() const { return words_; }
  size_t size() const { return words_.size(); }
  // The fields whose words differ between rank 0 and another rank, given
  // every rank's words (rank-major, size() each), as
  // "NAME: rank 0 has A, rank 1 has B" joined with "; " (at most
  // `max_fields`, then "and N more"). `skip` names fields left out of the
  // message (still reported in `differs`). Empty when all agree.
  std::string diff(const uint64_t *all, int world, size_t max_fields = 4,
                   const std::vector<std::string> &skip = {}, std::vector<std::string> *differs = nullptr) const;
  // The ranks whose field `name` differs from rank 0's.
  std::vector<int> ranks_differing(const uint64_t *all, int world, const std::string &name) const;

 private:
  struct Field {
    std::string name;
    Kind kind;
    size_t at, n;
  };
  const Field *find(const std::string &name) const;
  std::string value(const Field &f, const uint64_t *w) const;
  void push(std::string name, Kind k, const uint64_t *w, size_t n);
  std::vector<Field> fields_;
  std::vector<uint64_t> words_;
};

// Finalize at W > 1: every rank built the same optimizer and holds the
// same params (a collective). INVALID_ARGUMENT naming each setting that
// differs and the ranks' values.
zopt_status agree_at_finalize(zopt_optimizer *o);

// The step's settings that every rank must share, in a fixed order: seed,
// gradient divisor, loss scale, max_norm, and per group its step count and
// hyperparameters.
Settings step_settings(const zopt_optimizer *o);

// After the step's settings hashes differ: exchanges the settings
// themselves (every rank calls it: every rank saw the same hashes) and
// returns the INVALID_ARGUMENT naming what differs.
zopt_status explain_step_disagreement(zopt_optimizer *o);

}  // namespace zopt

#endif
