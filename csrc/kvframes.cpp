// The tcp target's DATA frame loop and the grant mirror it checks (channels/tcp/frames.py, channels/grants.py).
//
// Why: the Python loop spends tens of microseconds of interpreter time per
// frame (read the header, unpack and check it, read the run table, check the
// runs, take the grant lock, land, release) where the bytes themselves take
// a few. Here one call serves consecutive DATA frames of one connection with
// the GIL released (ctypes drops it) and comes back to Python only:
//   - to drain completions: each frame with LAST that landed is queued in a
//     ring with its notification (read here), and Python delivers them, ends
//     their shares and ACKs them in one pass (PDKV_FRAME_DRAIN) once no more
//     input waits, the ring is full, or before a payload that owed ACKs must
//     not wait behind;
//   - for a frame it does not take (not DATA, any field the Python checks
//     would refuse, a run table that fails the run check, a run outside the
//     grants): it hands back what it read of it, the header
//     (PDKV_FRAME_HEADER) or the header and run table (PDKV_FRAME_TABLE), and
//     Python serves that frame the way it serves every frame, so the refusal,
//     its message and the NACK or hang-up are Python's own;
//   - at EOF or a socket error (io[] says where in the frame and how far).
//
// The grant mirror is a copy of one Grants object's write grants that only
// Python writes, under its own lock (guard, set a (token, region)'s spans,
// as Grants computed them): the loop only admits a frame against it (all
// runs or none) and holds a ticket while the frame lands, and Grants.revoke
// waits here for every ticket that overlaps what it removed.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvnet.h"
#include "tcpwire.h"

namespace {

namespace wire = pdkv::tcpwire;

using Span = std::pair<int64_t, int64_t>;  // [start, end)
using Range = std::array<int64_t, 3>;      // region, offset, length

struct Flight {
  std::string token;
  std::vector<Range> ranges;
};

struct Mirror {
  std::mutex mu;
  std::condition_variable landed;  // a ticket ended
  std::unordered_set<int64_t> guarded;
  std::map<std::pair<std::string, int64_t>, std::vector<Span>> spans;  // (token, region) -> sorted spans
  std::unordered_map<int64_t, Flight> flights;                          // ticket -> what it lands in
  int64_t next_ticket = 1;
};

// channels/grants.py _covers, step by step (touching neighbours chain; the same answer for the same spans).
bool covers(const std::vector<Span>& spans, int64_t start, int64_t end) {
  auto it = std::upper_bound(spans.begin(), spans.end(), Span{start, std::numeric_limits<int64_t>::max()});
  if (it == spans.begin()) return false;
  for (--it; it != spans.end() && it->first <= start && start < it->second; ++it) {
    if (it->second >= end) return true;
    start = it->second;
  }
  return false;
}

Range run_at(const char* table, int64_t k) {
  wire::RunRegionT r;
  wire::RunOffsetT off;
  wire::RunLengthT len;
  wire::read_run(table, k, &r, &off, &len);
  return Range{static_cast<int64_t>(r), static_cast<int64_t>(off), static_cast<int64_t>(len)};
}

// Admit a frame's runs (checked by pdkv_check_runs: inside regions) for `token`, all or none: 0 and *ticket (0 when
// no run is in a guarded region), or 1 if a guarded run is not covered by the token's spans.
int begin(Mirror* m, const std::string& token, const char* table, int64_t nruns, int64_t* ticket) {
  std::vector<Range> guarded;
  std::lock_guard<std::mutex> lock(m->mu);
  for (int64_t k = 0; k < nruns; ++k) {
    const Range run = run_at(table, k);
    if (!m->guarded.count(run[0])) continue;
    const auto it = m->spans.find({token, run[0]});
    if (it == m->spans.end() || !covers(it->second, run[1], run[1] + run[2])) return 1;
    guarded.push_back(run);
  }
  *ticket = 0;
  if (guarded.empty()) return 0;
  *ticket = m->next_ticket++;
  m->flights.emplace(*ticket, Flight{token, std::move(guarded)});
  return 0;
}

void end(Mirror* m, int64_t ticket) {
  if (!ticket) return;
  {
    std::lock_guard<std::mutex> lock(m->mu);
    m->flights.erase(ticket);
  }
  m->landed.notify_all();
}

// Fill buf[0, n) from the blocking socket (SO_RCVTIMEO ticks). At a frame boundary an idle socket is normal (no
// tick counts until a byte came); inside a frame max_idle ticks without a byte give up. *got: bytes received.
int recv_exact(int fd, char* buf, int64_t n, bool boundary, int64_t max_idle, int64_t* got, int64_t* os_error) {
  int64_t idle = 0;
  *got = 0;
  while (*got < n) {
    const ssize_t r = recv(fd, buf + *got, static_cast<size_t>(n - *got), MSG_WAITALL);
    if (r > 0) {
      *got += r;
      idle = 0;
    } else if (r == 0) {
      return boundary && *got == 0 ? PDKV_FRAME_CLOSED : PDKV_LAND_EOF;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if ((!boundary || *got) && ++idle >= max_idle) return PDKV_LAND_STALLED;
    } else if (errno != EINTR) {
      *os_error = errno;
      return PDKV_LAND_EOS;
    }
  }
  return PDKV_OK;
}

// Between frames: wait until fd has bytes (or EOF, or an error: recv says which), true; or until `wake` is readable
// first, false. No timeout: an idle connection between frames is normal, and the pool wakes its thread.
bool wait_frame(int fd, int wake) {
  pollfd p[2] = {{fd, POLLIN, 0}, {wake, POLLIN, 0}};
  for (;;) {
    const int r = poll(p, 2, -1);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 || p[0].revents) return true;
    if (p[1].revents) return false;
  }
}

template <typename T>
T field(const char* hdr, int64_t at) {
  T v;
  std::memcpy(&v, hdr + at, sizeof(T));
  return v;
}

}  // namespace

// See kvnet.h.
PDKV_API void* pdkv_grants_new() { return new Mirror(); }

PDKV_API void pdkv_grants_free(void* grants) { delete static_cast<Mirror*>(grants); }

PDKV_API void pdkv_grants_guard(void* grants, int64_t region, int on) {
  auto* m = static_cast<Mirror*>(grants);
  std::lock_guard<std::mutex> lock(m->mu);
  if (on) {
    m->guarded.insert(region);
  } else {
    m->guarded.erase(region);
  }
}

PDKV_API void pdkv_grants_add(void* grants, const char* token, int64_t token_len, const int64_t* ranges, int64_t n) {
  auto* m = static_cast<Mirror*>(grants);
  std::lock_guard<std::mutex> lock(m->mu);
  const std::string tok(token, static_cast<size_t>(token_len));
  for (int64_t i = 0; i < n; ++i) {  // grants.py grant: bisect.insort of each range's span
    const int64_t* r = ranges + 3 * i;
    std::vector<Span>& held = m->spans[{tok, r[0]}];
    const Span span{r[1], r[1] + r[2]};
    held.insert(std::upper_bound(held.begin(), held.end(), span), span);
  }
}

PDKV_API void pdkv_grants_remove(void* grants, const char* token, int64_t token_len, const int64_t* ranges, int64_t n) {
  auto* m = static_cast<Mirror*>(grants);
  std::lock_guard<std::mutex> lock(m->mu);
  const std::string tok(token, static_cast<size_t>(token_len));
  for (int64_t i = 0; i < n; ++i) {  // grants.py revoke: _subtract each range from the spans held, where any are
    const int64_t* r = ranges + 3 * i;
    const auto it = m->spans.find({tok, r[0]});
    if (it == m->spans.end()) continue;
    const int64_t start = r[1], end = r[1] + r[2];
    std::vector<Span> out;
    for (const Span& s : it->second) {
      if (s.second <= start || end <= s.first) {
        out.push_back(s);
        continue;
      }
      if (s.first < start) out.emplace_back(s.first, start);
      if (end < s.second) out.emplace_back(end, s.second);
    }
    it->second = std::move(out);
  }
}

PDKV_API int pdkv_grants_begin(void* grants, const char* token, int64_t token_len, const char* runs, int64_t nruns,
                               int64_t* ticket) {
  return begin(static_cast<Mirror*>(grants), std::string(token, static_cast<size_t>(token_len)), runs, nruns, ticket);
}

PDKV_API void pdkv_grants_end(void* grants, int64_t ticket) { end(static_cast<Mirror*>(grants), ticket); }

PDKV_API int pdkv_grants_wait(void* grants, const char* token, int64_t token_len, const int64_t* ranges, int64_t n,
                              int64_t timeout_us) {
  auto* m = static_cast<Mirror*>(grants);
  const std::string tok(token, static_cast<size_t>(token_len));
  const auto overlapping = [&] {
    for (const auto& [ticket, flight] : m->flights) {
      if (flight.token != tok) continue;
      for (const Range& f : flight.ranges) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t* r = ranges + 3 * i;
          if (f[0] == r[0] && f[1] < r[1] + r[2] && r[1] < f[1] + f[2]) return true;
        }
      }
    }
    return false;
  };
  std::unique_lock<std::mutex> lock(m->mu);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(std::max<int64_t>(timeout_us, 0));
  return m->landed.wait_until(lock, deadline, [&] { return !overlapping(); }) ? 0 : 1;
}

// See kvnet.h.
PDKV_API int pdkv_serve_frames(int fd, void* grants, const char* token, int64_t token_len, const int64_t* desc,
                               int64_t n_desc, const int64_t* generation, const int64_t* limits, uint64_t* share,
                               char* hdr, char* table, int64_t* ring, char* notifs, int64_t* io) {
  auto* m = static_cast<Mirror*>(grants);
  const int64_t piece = limits[0], max_idle = limits[1], max_frame = limits[2], max_notif = limits[3];
  const int64_t flush = limits[4], snapshot = limits[5], ring_cap = limits[6], notif_cap = limits[7];
  const bool acks_held = limits[8];
  const int wake = static_cast<int>(limits[9]);
  if (ring_cap < 1 || notif_cap < max_notif || piece <= 0) return PDKV_LAND_EARG;  // room for one completion at least
  const std::string tok(token, static_cast<size_t>(token_len));
  std::fill(io, io + 5, 0);  // frames landed, part (0 header, 1 run table, 2 payload, 3 notification), got, wanted, errno
  ring[0] = 0;
  int64_t used = 0;  // bytes of notifs holding the ring's notifications
  bool first = true;  // the call's first header: only it may wait on the wake fd (the loop reads on only when bytes wait)
  for (;;) {
    int rc = PDKV_OK;
    if (share[2]) {
      share[2] = 0;  // the header read before the last return: serve it now
    } else {
      if (wake >= 0 && first && !wait_frame(fd, wake)) return PDKV_FRAME_IDLE;
      first = false;
      rc = recv_exact(fd, hdr, wire::kHeaderBytes, true, max_idle, &io[2], &io[4]);
      io[3] = wire::kHeaderBytes;
      if (rc != PDKV_OK) return rc;
    }
    const uint8_t ftype = field<wire::HeaderTypeT>(hdr, wire::kHeaderType);
    const uint8_t flags = field<wire::HeaderFlagsT>(hdr, wire::kHeaderFlags);
    const int64_t shares = field<wire::HeaderSharesT>(hdr, wire::kHeaderShares), nruns = field<wire::HeaderAuxT>(hdr, wire::kHeaderAux);
    const int64_t nlen = field<wire::HeaderNotifT>(hdr, wire::kHeaderNotif);
    const uint64_t xfer = field<wire::HeaderXferT>(hdr, wire::kHeaderXfer);
    const uint64_t offset = field<wire::HeaderOffsetT>(hdr, wire::kHeaderOffset);
    const uint64_t length = field<wire::HeaderLengthT>(hdr, wire::kHeaderLength);
    // anything the Python checks (frames.py FrameServer.serve, lander.py Lander.runs) could refuse is theirs to refuse
    const bool last = flags & wire::kLast, notif = flags & wire::kNotifFollows;
    const bool fast = std::memcmp(hdr + wire::kHeaderMagic, wire::kMagic, sizeof wire::kMagic) == 0 &&
                      field<wire::HeaderVersionT>(hdr, wire::kHeaderVersion) == wire::kVersion && ftype == wire::kData &&
                      (!share[0] || xfer == share[1]) && !(flags & ~(wire::kLast | wire::kNotifFollows)) && nlen <= max_notif &&
                      (!nlen || notif) && (last ? 1 <= shares && shares <= wire::kMaxStreams : !flags && !shares) &&
                      1 <= nruns && nruns <= wire::kMaxRuns && !offset && 0 < length &&
                      length <= static_cast<uint64_t>(max_frame);
    if (!fast) return PDKV_FRAME_HEADER;
    // completions owed (in the ring, or ACKs Python holds) go out before a large payload lands, as in Python
    if ((ring[0] || acks_held) && (length >= static_cast<uint64_t>(flush) || used + nlen > notif_cap)) {
      share[2] = 1;
      return PDKV_FRAME_DRAIN;
    }
    io[1] = 1;
    io[3] = nruns * wire::kRunBytes;
    rc = recv_exact(fd, table, nruns * wire::kRunBytes, false, max_idle, &io[2], &io[4]);
    if (rc != PDKV_OK) return rc;
    int64_t ticket = 0;
    // regions registered or dropped since desc was taken: Python checks this frame under the new descriptors
    if (__atomic_load_n(generation, __ATOMIC_ACQUIRE) != snapshot ||
        pdkv_check_runs(table, nruns, desc, n_desc, static_cast<int64_t>(length)) || begin(m, tok, table, nruns, &ticket)) {
      return PDKV_FRAME_TABLE;
    }
    io[1] = 2;
    io[3] = static_cast<int64_t>(length);
    int os_error = 0;
    rc = pdkv_recv_runs(fd, table, nruns, desc, n_desc, piece, max_idle, &io[2], &os_error);
    end(m, ticket);
    io[4] = os_error;
    if (rc != PDKV_OK) return rc;
    ++io[0];
    share[0] = !last;
    share[1] = xfer;
    if (!last) {
      io[1] = 0;
      // the share goes on in the next frame; if none has begun, back to Python, which parks the connection (or waits
      // for it here again, on the wake fd): a connection quiet inside a share holds no thread either
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 0) <= 0) return PDKV_FRAME_DRAIN;
      continue;
    }
    if (notif) {
      io[1] = 3;
      io[3] = nlen;
      rc = recv_exact(fd, notifs + used, nlen, false, max_idle, &io[2], &io[4]);
      if (rc != PDKV_OK) return rc;
    }
    io[1] = 0;
    int64_t* entry = ring + 1 + 4 * ring[0]++;
    entry[0] = static_cast<int64_t>(xfer);
    entry[1] = shares;
    entry[2] = used;
    entry[3] = notif ? nlen : -1;
    used += nlen;
    // back to Python when nothing more waits (the ACKs go out now), the ring is full, or a share of several
    // streams ended (Python ends it across them before anything after it lands)
    pollfd p{fd, POLLIN, 0};
    if (ring[0] >= ring_cap || shares > 1 || poll(&p, 1, 0) <= 0) return PDKV_FRAME_DRAIN;
  }
}
