// checkpoint/linked.cpp - the checkpoint of an optimizer of several parts
// (one zopt_optimizer per parameter class, stepped by
// zopt_optimizer_step_linked): zopt_optimizer_save_linked, ONE save with
// one identity and one commit point over every part (save.cpp's mechanism,
// of which zopt_optimizer_save is the one-part case), and
// zopt_optimizer_load_linked, which loads the parts of one save or none
// (docs/CHECKPOINT.md "Linked saves").
#include "internal.h"

#include "checkpoint/format.h"
#include "checkpoint/image.h"
#include "checkpoint/set.h"

#include "comm/comm_internal.h"

#include <optional>
#include <string>
#include <vector>

using namespace zopt;

namespace {

constexpr int kMaxParts = 64;

// The arguments of a linked save or load: n in [1, 64] distinct, finalized
// parts of one world and rank, idle, each held for the call (`holds`), and
// n distinct non-empty paths.
zopt_status check_parts(zopt_optimizer *const *parts, int n, const char *const *paths, const char *fn,
                        std::optional<CallHold> *holds) {
  if (!parts || !paths || n < 1 || n > kMaxParts)
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: %s", fn,
                !parts ? "parts is NULL" : !paths ? "paths is NULL" : "n must be in [1, 64]");
  for (int i = 0; i < n; ++i) {
    const zopt_optimizer *o = parts[i];
    if (!o) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: part %d is NULL", fn, i);
    for (int j = 0; j < i; ++j)
      if (parts[j] == o) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: parts %d and %d are the same optimizer", fn, j, i);
    if (!holds[i].emplace(o, fn).held()) return holds[i]->refuse();
    if (zopt_status st = check_idle(o, fn)) return st;
    if (!o->finalized) return fail(ZOPT_ERR_BAD_STATE, "%s: part %d ('%s') is not finalized", fn, i, o->d->name);
    if (o->world != parts[0]->world || o->rank != parts[0]->rank)
      return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: part %d is rank %d of %d, part 0 rank %d of %d", fn, i, o->rank,
                  o->world, parts[0]->rank, parts[0]->world);
    if (!paths[i] || !*paths[i]) return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: path %d is NULL or empty", fn, i);
    for (int j = 0; j < i; ++j)
      if (strcmp(paths[j], paths[i]) == 0)
        return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: parts %d and %d have the same path '%s'", fn, j, i, paths[i]);
  }
  return ZOPT_OK;
}

// Part i's failure, named (a linked load of several parts).
zopt_status in_part(zopt_status st, int i, const char *path) {
  return fail(st, "zopt_optimizer_load_linked: part %d ('%s'): %s", i, path, std::string(zopt_last_error()).c_str());
}

// Stages every part (nothing changed): part 0's set at paths[0]; each other
// part's set must be of the same save (docs/CHECKPOINT.md "Linked saves").
zopt_status stage_parts(zopt_optimizer *const *parts, int n, const char *const *paths, uint32_t flags,
                        std::vector<ckpt::Staged> &sg) {
  using ckpt::File;
  File h0;
  if (zopt_status st = ckpt::read_header(h0, paths[0])) return in_part(st, 0, paths[0]);
  const bool linked = h0.version >= 3 && h0.linked;
  const std::string x = ckpt::hex(h0.id);
  for (int i = 0; i < n; ++i) {
    std::string file0 = paths[i];
    if (i > 0) {
      File hi;
      const zopt_status rs = ckpt::read_header(hi, paths[i]);
      const bool hi_linked = !rs && hi.version >= 3 && hi.linked;
      if (!linked) {
        // Part 0 written by a single-class save (a runtime before linked
        // saves): the parts load as they are (they cannot be checked); a
        // part of a linked save with it is not of the same save.
        if (hi_linked)
          return ckpt::ck_fail(paths[i],
                               "(part %d) belongs to another save: it is a part of the linked save %s, and part 0's "
                               "file '%s' is not a linked save's (its save identity is %s): the classes of one "
                               "checkpoint were saved by different saves",
                               i, ckpt::hex(hi.id).c_str(), paths[0], x.c_str());
      } else if (rs || !hi_linked || hi.id != h0.id) {
        // A save that died after its commit, before part i's rename: part
        // i's file is still under its set name.
        const std::string rec = ckpt::set_file(paths[i], 0, h0.world, h0.id);
        File hr;
        const zopt_status rr = ckpt::read_header(hr, rec);
        if (!rr && hr.version >= 3 && hr.linked && hr.id == h0.id) {
          file0 = rec;
        } else if (rs == ZOPT_ERR_IO && rr == ZOPT_ERR_IO) {
          return fail(ZOPT_ERR_IO,
                      "zopt_optimizer_load_linked: part %d: neither '%s' nor '%s' can be read (part %d of the save "
                      "%s that '%s' names)",
                      i, paths[i], rec.c_str(), i, x.c_str(), paths[0]);
        } else if (rs) {
          return in_part(rs, i, paths[i]);  // (its reader's error)
        } else {
          return ckpt::ck_fail(paths[i],
                               "(part %d) belongs to another save: its save identity is %s%s, part 0's file '%s' "
                               "names %s: the classes of one checkpoint were saved by different saves",
                               i, ckpt::hex(hi.id).c_str(),
                               hi.version < 3 ? " (format 2: none)" : hi.linked ? "" : " (not a linked save)",
                               paths[0], x.c_str());
        }
      }
    }
    if (zopt_status st = ckpt::stage_path(parts[i], paths[i], flags, sg[(size_t)i], file0.c_str()))
      return n > 1 ? in_part(st, i, paths[i]) : st;
  }
  return ZOPT_OK;
}

}  // namespace

extern "C" {

ZOPT_API zopt_status zopt_optimizer_save_linked(zopt_optimizer *const *parts, int n, const char *const *paths) {
  std::optional<CallHold> holds[kMaxParts];  // every part, for the whole save
  if (zopt_status st = check_parts(parts, n, paths, "zopt_optimizer_save_linked", holds)) return st;
  return ckpt::save_parts(parts, n, paths, n == 1 ? "zopt_optimizer_save" : "zopt_optimizer_save_linked");
}

ZOPT_API zopt_status zopt_optimizer_load_linked(zopt_optimizer *const *parts, int n, const char *const *paths,
                                                uint32_t flags) {
  const char *fn = "zopt_optimizer_load_linked";
  std::optional<CallHold> holds[kMaxParts];
  if (zopt_status st = check_parts(parts, n, paths, fn, holds)) return st;
  if (flags & ~(uint32_t)(ZOPT_LOAD_ALLOW_RULE_CHANGE | ZOPT_LOAD_VALIDATE_ONLY))
    return fail(ZOPT_ERR_INVALID_ARGUMENT, "%s: unknown flags 0x%x", fn, flags);
  std::vector<ckpt::Staged> sg((size_t)n);
  zopt_status st = stage_parts(parts, n, paths, flags, sg);
  // Nothing applied yet (kSigUnchanged): a rank at another call fails this
  // load cleanly; a part refused on one rank changes nothing on any.
  if (zopt_status ag = ckpt::agree_status(parts[0], st, "LOAD status", kSigUnchanged)) return ag;
  for (int i = 0; i < n; ++i)
    if (zopt_status ag = ckpt::agree_staged(parts[i], sg[(size_t)i], fn, "LOAD save and settings")) return ag;
  if (flags & ZOPT_LOAD_VALIDATE_ONLY) return ZOPT_OK;
  for (int i = 0; i < n; ++i)
    if (zopt_status e = ckpt::apply(parts[i], sg[(size_t)i])) return e;
  return ZOPT_OK;
}

}  // extern "C"
