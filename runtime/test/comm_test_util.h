// comm_test_util.h - shared by the communicator tests (test_comm*.cpp):
// thread-safe checks, the test data (never zero bytes) and the expected
// results of the collectives.
#ifndef ZOPT_COMM_TEST_UTIL_H
#define ZOPT_COMM_TEST_UTIL_H

#include "zopt/comm.h"

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace ct {

inline std::atomic<int> &failures() {
  static std::atomic<int> n{0};
  return n;
}
inline std::mutex &print_mu() {
  static std::mutex m;
  return m;
}
inline std::string &prefix() {  // "rank 2: " in multi-process tests
  static std::string p;
  return p;
}

inline void report(bool ok, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
inline void report(bool ok, const char *file, int line, const char *fmt, ...) {
  if (ok) return;
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(print_mu());
  fprintf(stderr, "%sFAIL %s:%d: %s\n", prefix().c_str(), file, line, buf);
  fflush(stderr);
  failures()++;
}

#define CT_CHECK(cond, ...) ::ct::report((cond), __FILE__, __LINE__, __VA_ARGS__)
#define CT_OK(call)                                                                                      \
  do {                                                                                                   \
    zopt_status ct_st_ = (call);                                                                         \
    ::ct::report(ct_st_ == ZOPT_OK, __FILE__, __LINE__, "%s -> %d: %s", #call, (int)ct_st_,              \
                 zopt_last_error());                                                                     \
  } while (0)
// Expects status `code` and a message containing each of the strings in
// `needles` (a brace list); returns the message.
inline std::string expect_err(zopt_status got, zopt_status code, std::initializer_list<std::string> needles,
                              const char *call, const char *file, int line) {
  std::string msg = zopt_last_error();
  report(got == code, file, line, "%s -> %d (want %d): %s", call, (int)got, (int)code, msg.c_str());
  for (const std::string &n : needles)
    report(msg.find(n) != std::string::npos, file, line, "%s: message lacks \"%s\": %s", call, n.c_str(),
           msg.c_str());
  return msg;
}
#define CT_ERR(call, code, ...) ::ct::expect_err((call), (code), {__VA_ARGS__}, #call, __FILE__, __LINE__)

inline void pass(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
inline void pass(const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lk(print_mu());
  printf("%sPASS %s\n", prefix().c_str(), buf);
  fflush(stdout);
}

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Byte i of the piece rank `src` sends to rank `dst` in round `round`:
// pseudo-random, never zero (so a missing copy cannot pass).
inline uint8_t byte(uint64_t round, int src, int dst, size_t i) {
  uint64_t x = round * 0x9E3779B97F4A7C15ull ^ ((uint64_t)src << 40) ^ ((uint64_t)(dst + 1) << 52) ^ i;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return (uint8_t)(x % 255u + 1u);
}

// all_to_all: rank r's send buffer (W pieces, piece q for rank q).
inline void fill_all_to_all(uint8_t *send, uint64_t round, int r, int W, size_t B) {
  for (int q = 0; q < W; ++q)
    for (size_t i = 0; i < B; ++i) send[(size_t)q * B + i] = byte(round, r, q, i);
}
// Returns "" or a description of the first wrong byte of rank r's recv.
inline std::string check_all_to_all(const uint8_t *recv, uint64_t round, int r, int W, size_t B) {
  for (int q = 0; q < W; ++q)
    for (size_t i = 0; i < B; ++i)
      if (recv[(size_t)q * B + i] != byte(round, q, r, i)) {
        char b[160];
        snprintf(b, sizeof b, "all_to_all round %llu: piece %d byte %zu is 0x%02x, want 0x%02x",
                 (unsigned long long)round, q, i, recv[(size_t)q * B + i], byte(round, q, r, i));
        return b;
      }
  return "";
}
// all_gather: rank r sends byte(round, r, -1, i).
inline void fill_all_gather(uint8_t *send, uint64_t round, int r, size_t B) {
  for (size_t i = 0; i < B; ++i) send[i] = byte(round, r, -1, i);
}
inline std::string check_all_gather(const uint8_t *recv, uint64_t round, int W, size_t B) {
  for (int q = 0; q < W; ++q)
    for (size_t i = 0; i < B; ++i)
      if (recv[(size_t)q * B + i] != byte(round, q, -1, i)) {
        char b[160];
        snprintf(b, sizeof b, "all_gather round %llu: piece %d byte %zu is 0x%02x, want 0x%02x",
                 (unsigned long long)round, q, i, recv[(size_t)q * B + i], byte(round, q, -1, i));
        return b;
      }
  return "";
}

}  // namespace ct

#endif
