// Landing a tcp DATA frame and hashing it while it is in cache (channels/landing.py is the Python side).
//
// Why: verifying a direct-mode chunk by reading every landed byte again from
// memory costs a second pass over the KV. The checksum is linear (kvsum.h):
// a unit's accumulator is a sum over its rows, so the receiving thread can
// hash each piece right after the socket copied it into the region (at most
// `piece` bytes: still in cache) and add it to the unit's running partial.
// Verification then combines the partials with each unit's position weight.
//
// A region's landing table holds three int64 words per unit (kvland_* below):
//   partial: sum over the landed pieces of f(0) * g(r) * rowsum (the weight of
//            unit 0: the unit's position in a chunk is only known at
//            verification, where f(j) * f(0)^-1 moves it there; f is odd, so
//            f(0) has an inverse mod 2**64);
//   sig:     sum over the landed pieces [a, b) of H(b) - H(a), H a random
//            function of the offset in the unit: H(unit) - H(0) exactly when
//            the pieces tile the unit (a chain from 0 to unit; a piece landed
//            twice or one missing leaves another sum, but for a 2**-64 chance);
//   filled:  bytes landed, plus kPoison for every piece being received or
//            that could not be hashed on its own (not word-aligned): a piece
//            whose receive failed halfway leaves the poison in place.
// A unit counts as hashed only when filled == unit and sig == H(unit) - H(0);
// any other unit is read from memory at verification, as before. The
// receiver resets a unit's entry whenever it is granted (a new owner), so no
// partial outlives the grant it was landed under.
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kvnet.h"
#include "kvsum.h"
#include "tcpwire.h"

namespace {

constexpr int64_t kPoison = int64_t{1} << 40;
constexpr uint64_t kSigSalt = 0xD1B54A32D192ED03ull;
constexpr int64_t kDesc = 5;  // a region's descriptor: base, size, unit (0: not hashed), table, units
namespace wire = pdkv::tcpwire;
constexpr int kMaxIov = 1024;

uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t sig_at(int64_t offset) { return mix64(static_cast<uint64_t>(offset) ^ kSigSalt); }

// The inverse of an odd x mod 2**64 (Newton's iteration: each step doubles the correct low bits).
uint64_t inverse(uint64_t x) {
  uint64_t y = x;  // correct to 3 bits for odd x
  for (int i = 0; i < 5; ++i) y *= 2 - x * y;
  return y;
}

struct Region {
  char* base;
  int64_t size;
  int64_t unit;
  int64_t* table;
  int64_t units;
};

Region region_at(const int64_t* desc, uint32_t r) {
  const int64_t* d = desc + static_cast<int64_t>(r) * kDesc;
  return Region{reinterpret_cast<char*>(d[0]), d[1], d[2], reinterpret_cast<int64_t*>(d[3]), d[4]};
}

void add(int64_t* word, int64_t v) { __atomic_fetch_add(word, v, __ATOMIC_RELAXED); }

// Mark every unit that [off, off+len) of the region touches as landing (before its bytes arrive).
void poison(const Region& g, int64_t off, int64_t len) {
  for (int64_t u = off / g.unit; u * g.unit < off + len; ++u) add(g.table + 3 * u + 2, kPoison);
}

// Hash [off, off+len) of the region, just landed, into its units' entries and lift the poison `poison` put there;
// a piece not word-aligned in its unit keeps its poison (that unit is read again at verification).
void hash_landed(const Region& g, int64_t off, int64_t len) {
  const pdkv::Cut cut(g.unit);
  for (int64_t u = off / g.unit; u * g.unit < off + len; ++u) {
    const int64_t start = u * g.unit;
    const int64_t a = std::max(off, start) - start;
    const int64_t b = std::min(off + len, start + g.unit) - start;
    if (a % cut.word || (b - a) % cut.word) continue;
    const uint64_t q = pdkv::hash_range<false>(cut, 0, a, g.base + start + a, nullptr, b - a);
    int64_t* e = g.table + 3 * u;
    add(e, static_cast<int64_t>(q));
    add(e + 1, static_cast<int64_t>(sig_at(b) - sig_at(a)));
    add(e + 2, b - a - kPoison);
  }
}

int fail(int code, const std::string& what, char* err, size_t err_len) {
  if (err && err_len) std::snprintf(err, err_len, "pdkv landing: %s", what.c_str());
  return code;
}

struct Segment {
  Region region;
  int64_t off;
  int64_t len;
};

}  // namespace

// See kvnet.h.
PDKV_API int pdkv_check_runs(const char* runs, int64_t nruns, const int64_t* desc, int64_t n_desc, int64_t length) {
  struct Run {
    uint64_t region, off, len;
  };
  std::vector<Run> all(static_cast<size_t>(nruns < 0 ? 0 : nruns));
  uint64_t total = 0;
  for (int64_t k = 0; k < nruns; ++k) {
    wire::RunRegionT r;
    wire::RunOffsetT off;
    wire::RunLengthT len;
    wire::read_run(runs, k, &r, &off, &len);
    if (static_cast<int64_t>(r) >= n_desc) return 1;  // not registered
    const uint64_t size = static_cast<uint64_t>(desc[static_cast<int64_t>(r) * kDesc + 1]);
    if (len == 0 || off > size || len > size - off) return 1;  // empty, or not inside the region
    total += len;  // each at most a region's size: no overflow for any nruns the wire allows
    all[static_cast<size_t>(k)] = Run{r, off, len};
  }
  if (total != static_cast<uint64_t>(length)) return 1;
  std::sort(all.begin(), all.end(), [](const Run& a, const Run& b) { return a.region != b.region ? a.region < b.region : a.off < b.off; });
  for (size_t k = 1; k < all.size(); ++k) {
    if (all[k].region == all[k - 1].region && all[k].off < all[k - 1].off + all[k - 1].len) return 1;  // overlap
  }
  return 0;
}

// See kvnet.h.
PDKV_API int pdkv_recv_runs(int fd, const char* runs, int64_t nruns, const int64_t* desc, int64_t n_desc, int64_t piece,
                            int64_t max_idle, int64_t* got, int* os_error) {
  *got = 0;
  *os_error = 0;
  if (piece <= 0) return PDKV_LAND_EARG;
  std::vector<Segment> segs;  // one piece's parts: at most `piece` bytes, from one or more runs
  iovec iov[kMaxIov];
  int64_t k = 0, at = 0;  // the next byte to receive: run k, byte `at` of it
  while (k < nruns) {
    segs.clear();
    int64_t want = 0, hashed = 0;  // bytes in this piece; of them, bytes to hash (at most `piece`)
    while (k < nruns && hashed < piece && static_cast<int64_t>(segs.size()) < kMaxIov) {
      wire::RunRegionT r;
      wire::RunOffsetT off_field;
      wire::RunLengthT len_field;
      wire::read_run(runs, k, &r, &off_field, &len_field);
      const int64_t off = static_cast<int64_t>(off_field), len = static_cast<int64_t>(len_field);
      if (static_cast<int64_t>(r) >= n_desc) return PDKV_LAND_EARG;  // the caller checked every run: never here
      const Region g = region_at(desc, r);
      const int64_t n = g.unit ? std::min(len - at, piece - hashed) : len - at;  // unhashed bytes: no need to cut
      segs.push_back(Segment{g, off + at, n});
      want += n;
      if (g.unit) hashed += n;
      at += n;
      if (at == len) {
        ++k;
        at = 0;
      }
    }
    for (size_t i = 0; i < segs.size(); ++i) {
      iov[i] = iovec{segs[i].region.base + segs[i].off, static_cast<size_t>(segs[i].len)};
      if (segs[i].region.unit) poison(segs[i].region, segs[i].off, segs[i].len);
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = segs.size();
    int64_t have = 0, idle = 0;
    while (have < want) {
      const ssize_t n = recvmsg(fd, &msg, MSG_WAITALL);
      if (n > 0) {
        have += n;
        *got += n;
        idle = 0;
        for (size_t left = static_cast<size_t>(n); left;) {  // step over what arrived
          if (left >= msg.msg_iov->iov_len) {
            left -= msg.msg_iov->iov_len;
            ++msg.msg_iov;
            --msg.msg_iovlen;
          } else {
            msg.msg_iov->iov_base = static_cast<char*>(msg.msg_iov->iov_base) + left;
            msg.msg_iov->iov_len -= left;
            left = 0;
          }
        }
      } else if (n == 0) {
        return PDKV_LAND_EOF;
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (++idle >= max_idle) return PDKV_LAND_STALLED;
      } else if (errno != EINTR) {
        *os_error = errno;
        return PDKV_LAND_EOS;
      }
    }
    for (const Segment& s : segs) {
      if (s.region.unit) hash_landed(s.region, s.off, s.len);
    }
  }
  return PDKV_OK;
}

// See kvnet.h.
PDKV_API int pdkv_landed_blocks(const int64_t* bases, const int64_t* tables, int64_t n_bases, const int64_t* ids, int64_t n_ids,
                                int64_t num_blocks, int64_t block_bytes, uint64_t* out, int64_t* reread, char* err, size_t err_len) {
  if (block_bytes <= 0 || n_bases < 0 || n_ids < 0) {
    return fail(PDKV_EVALUE, "block bytes must be positive and the counts non-negative", err, err_len);
  }
  for (int64_t i = 0; i < n_ids; ++i) {
    if (ids[i] < 0 || ids[i] >= num_blocks) {
      return fail(PDKV_EINDEX, "block id " + std::to_string(ids[i]) + " is out of range [0, " + std::to_string(num_blocks) + ")", err, err_len);
    }
  }
  const pdkv::Cut cut(block_bytes);
  const uint64_t whole = sig_at(block_bytes) - sig_at(0);
  uint64_t acc = 0;
  int64_t cold = 0;
  for (int64_t t = 0; t < n_bases; ++t) {
    const char* base = reinterpret_cast<const char*>(bases[t]);
    const int64_t* table = reinterpret_cast<const int64_t*>(tables[t]);
    for (int64_t i = 0; i < n_ids; ++i) {
      const int64_t* e = table + 3 * ids[i];
      uint64_t q;
      if (__atomic_load_n(e + 2, __ATOMIC_ACQUIRE) == block_bytes && static_cast<uint64_t>(__atomic_load_n(e + 1, __ATOMIC_RELAXED)) == whole) {
        q = static_cast<uint64_t>(__atomic_load_n(e, __ATOMIC_RELAXED));
      } else {  // not landed exactly once, in pieces that hashed: read it where it is
        q = pdkv::hash_range<false>(cut, 0, 0, base + ids[i] * block_bytes, nullptr, block_bytes);
        ++cold;
      }
      const uint64_t j = static_cast<uint64_t>(t * n_ids + i);
      acc += ((j * pdkv::kGolden + pdkv::kUnitSalt) | 1) * q;
    }
  }
  *out = acc * inverse(pdkv::kUnitSalt | 1);
  *reread = cold;
  return PDKV_OK;
}

// See kvnet.h.
PDKV_API void pdkv_landing_reset(const int64_t* desc, int64_t n_desc, const int64_t* ranges, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t region = ranges[3 * i], offset = ranges[3 * i + 1], length = ranges[3 * i + 2];
    if (region < 0 || region >= n_desc || length <= 0) continue;
    const int64_t* d = desc + region * kDesc;
    const int64_t unit = d[2], units = d[4];
    if (unit <= 0 || d[3] == 0) continue;  // not hashed as it lands
    const int64_t first = std::max<int64_t>(0, offset / unit);
    const int64_t end = std::min(units, (offset + length + unit - 1) / unit);
    if (first < end) std::memset(reinterpret_cast<int64_t*>(d[3]) + 3 * first, 0, static_cast<size_t>(end - first) * 3 * sizeof(int64_t));
  }
}

// See kvnet.h.
PDKV_API void pdkv_grid_ranges(const int64_t* regions, int64_t n_regions, const int64_t* runs, int64_t n_runs, int64_t* out) {
  for (int64_t i = 0; i < n_regions; ++i) {
    for (int64_t k = 0; k < n_runs; ++k, out += 3) {
      out[0] = regions[i];
      out[1] = runs[2 * k];
      out[2] = runs[2 * k + 1];
    }
  }
}
