// checkpoint/q8.h - loads between q8 moments and f32 / bf16 / f16 ones
// (docs/CHECKPOINT.md "q8 moments"): a set's q8 moment decoded (code x its
// block's absmax) into a step's wider moment, or a set's wider moment
// encoded (per block the absmax max |x|, then zopt_q8_encode) into a
// step's q8 codes and absmax. checkpoint.cpp's staging calls it for the
// runs it cannot copy or convert element by element.
#ifndef ZOPT_RUNTIME_CHECKPOINT_Q8_H
#define ZOPT_RUNTIME_CHECKPOINT_Q8_H

#include "internal.h"

#include <functional>
#include <vector>

namespace zopt {
namespace ckpt {

// The set's state `kind` of tensor t, units [a, e) of it (elements; blocks
// for an absmax) in the set's dtype, every unit covered; *dtype its dtype.
using ReadRange = std::function<zopt_status(uint32_t kind, size_t t, int64_t a, int64_t e,
                                            std::vector<unsigned char> *out, uint32_t *dtype)>;
// The set's dtype of `kind` (0: the set has none).
using FileDtype = std::function<uint32_t(uint32_t kind)>;

// Whether a step state (kind, dtype) loads by q8 conversion from a set.
bool q8_converts(uint32_t kind, uint32_t dt, const FileDtype &fdt);
// Whether a set's `kind` (absent from the step, or present) is a q8 absmax
// whose moment the step has: not a state of another rule.
bool q8_absmax_of_moment(uint32_t kind, const zopt_step_descriptor *d);
// The q8 conversion of units [start, start + len) of tensor t (numel
// elements) into `out` (len units of dtype dt): see the file's header.
zopt_status q8_stage(uint32_t kind, uint32_t dt, size_t t, int64_t numel, int64_t start, int64_t len,
                     const FileDtype &fdt, const ReadRange &read, unsigned char *out, const char *path);

}  // namespace ckpt
}  // namespace zopt

#endif
