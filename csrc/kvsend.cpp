// The tcp initiator's DATA frames of a block write, built and sent natively (channels/tcp/initiator.py).
//
// Why: a direct chunk is the same blocks of ~30 KV tensors. In Python each
// run of each tensor cost an op object, a memoryview slice and a packed run
// entry, and a chunk's post took 75 us (one run a tensor) to 460 us (16 runs):
// benchmarks/write_cost.py. Here pdkv_block_frames merges the block ids into
// runs, cuts the runs' bytes into the streams' shares exactly as
// initiator._split cuts ops and frames them as Initiator._write_batch does
// (the same bytes on the wire: tests/test_tcp_send_native.py compares them),
// writing headers and run tables into one buffer and every piece of a share
// as an iovec; pdkv_send_iov then sends a share's iovecs with sendmsg, the
// GIL released (ctypes drops it).
//
// A sealed write (sealed_tail > 0) is sent in two calls per share so that P
// hashes each piece right after the kernel copied it, not in a pass of its
// own before the first byte leaves (issue 46, step 2): pdkv_send_summed sends
// and hashes every frame of a share but a short tail, which goes last in a
// LAST frame of its own; the share that finishes last carries the
// notification, sealed over the sum of every share's part of the checksum.
// The notice's length is in that frame's header, ahead of its payload; hence
// the tail: the frames before it need nothing of the checksum. The receiver
// sees DATA frames it already takes (one run more a share), nothing new on the
// wire: it takes the notification from whichever share brings it.
#include <sys/socket.h>
#include <sys/uio.h>
#include <climits>
#include <cerrno>
#include <cstring>
#include <vector>

#include "kvnet.h"
#include "kvsum.h"
#include "tcpwire.h"

namespace {

namespace wire = pdkv::tcpwire;

struct Piece {
  int64_t share, addr, region, offset, length;
  bool tail = false;  // a sealed write's: hashed with the share, sent after it by the caller
};

template <typename T>
void put(char* at, T v) {
  std::memcpy(at, &v, sizeof(T));
}

char* header(char* at, uint8_t flags, uint16_t shares, uint32_t nruns, uint32_t notif, uint64_t xfer, uint64_t nbytes) {
  std::memset(at, 0, wire::kHeaderBytes);  // the pad byte and the offset field
  std::memcpy(at + wire::kHeaderMagic, wire::kMagic, sizeof wire::kMagic);
  put<wire::HeaderVersionT>(at + wire::kHeaderVersion, wire::kVersion);
  put<wire::HeaderTypeT>(at + wire::kHeaderType, wire::kData);
  put<wire::HeaderFlagsT>(at + wire::kHeaderFlags, flags);
  put<wire::HeaderSharesT>(at + wire::kHeaderShares, shares);
  put<wire::HeaderAuxT>(at + wire::kHeaderAux, nruns);
  put<wire::HeaderNotifT>(at + wire::kHeaderNotif, notif);
  put<wire::HeaderXferT>(at + wire::kHeaderXfer, xfer);
  put<wire::HeaderLengthT>(at + wire::kHeaderLength, nbytes);
  return at + wire::kHeaderBytes;
}

}  // namespace

// See kvnet.h.
PDKV_API int64_t pdkv_block_frames(const int64_t* local_bases, const int64_t* remote_regions, int64_t n_tensors,
                                   const int64_t* local_ids, const int64_t* remote_ids, int64_t n_ids,
                                   int64_t block_bytes, int64_t parts, int64_t max_frame, int64_t max_runs,
                                   uint64_t xfer, const char* notif, int64_t notif_len, char* tables,
                                   int64_t tables_cap, int64_t* iov, int64_t iov_cap, int64_t* shares,
                                   int64_t* offsets, int64_t sealed_tail, int64_t* tails) {
  if (n_tensors <= 0 || n_ids <= 0 || block_bytes <= 0 || parts <= 0 || max_frame <= 0 || max_runs <= 0) return -2;
  const bool sealed = sealed_tail > 0;
  if (sealed && notif_len >= 0) return -2;
  // runs of blocks adjacent on both sides (BlockWrite.runs): our first block, theirs, count
  std::vector<int64_t> runs;
  for (int64_t i = 0; i < n_ids; ++i) {
    const size_t n = runs.size();
    if (n && runs[n - 3] + runs[n - 1] == local_ids[i] && runs[n - 2] + runs[n - 1] == remote_ids[i]) {
      ++runs[n - 1];
    } else {
      runs.insert(runs.end(), {local_ids[i], remote_ids[i], 1});
    }
  }
  // initiator._split: near-equal shares, no piece longer than max_frame; a sealed write's shares end at a checksum
  // word (its frames need not be the Python path's), so that each share hashes whole words of the stream
  const int64_t total = n_tensors * n_ids * block_bytes;
  const int64_t word = pdkv::Cut(block_bytes).word;
  const int64_t even = (total + parts - 1) / parts;
  const int64_t share = sealed ? (even + word - 1) / word * word : even;
  std::vector<Piece> pieces;
  int64_t s = 0, room = share;
  for (int64_t t = 0; t < n_tensors; ++t) {
    for (size_t r = 0; r < runs.size(); r += 3) {
      int64_t lo = local_bases[t] + runs[r] * block_bytes, ro = runs[r + 1] * block_bytes;
      int64_t left = runs[r + 2] * block_bytes;
      while (left) {
        const int64_t n = std::min(left, std::min(room, max_frame));
        pieces.push_back({s, lo, remote_regions[t], ro, n});
        lo += n, ro += n, left -= n, room -= n;
        if (room == 0 && s < parts - 1) ++s, room = share;
      }
    }
  }
  if (sealed) {
    // each share's tail: its last piece's last sealed_tail bytes (cut at a word: up to a word more; all of a shorter
    // piece)
    std::vector<Piece> cut;
    cut.reserve(pieces.size() + static_cast<size_t>(parts));
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece& q = pieces[i];
      if (i + 1 < pieces.size() && pieces[i + 1].share == q.share) {
        cut.push_back(q);
        continue;
      }
      const int64_t head = q.length > sealed_tail ? (q.length - sealed_tail) / word * word : 0;
      if (head > 0) cut.push_back({q.share, q.addr, q.region, q.offset, head});
      cut.push_back({q.share, q.addr + head, q.region, q.offset + head, q.length - head, true});
    }
    pieces.swap(cut);
    int64_t at_byte = 0;  // the checksum hashes the payload as one stream: each piece's place in it must be a word's
    for (const Piece& q : pieces) {
      if (at_byte % word || q.length % word) return -3;
      at_byte += q.length;
    }
  }
  const int64_t nshares = pieces.back().share + 1;
  const int64_t npieces = static_cast<int64_t>(pieces.size());
  // Initiator._write_batch, share by share: frames of at most max_runs runs and max_frame bytes
  char* at = tables;
  int64_t k = 0, p = 0, stream = 0;
  const auto emit = [&](int64_t addr, int64_t len, bool payload) {
    if (k >= iov_cap) return false;
    iov[2 * k] = addr, iov[2 * k + 1] = len, offsets[k] = payload ? stream : -1, ++k;
    if (payload) stream += len;
    return true;
  };
  for (int64_t sh = 0; sh < nshares; ++sh) {
    shares[3 * sh] = k;
    int64_t share_bytes = 0;
    const auto framed = [&](int64_t i) { return i < npieces && pieces[i].share == sh && !pieces[i].tail; };
    while (framed(p)) {
      int64_t end = p, size = 0;
      while (framed(end) && end - p < max_runs && (end == p || size + pieces[end].length <= max_frame)) {
        size += pieces[end++].length;
      }
      const bool last = !sealed && !framed(end);
      const bool with_notif = last && sh == 0 && notif_len >= 0;
      const int64_t need = wire::kHeaderBytes + (end - p) * wire::kRunBytes;
      if (at + need > tables + tables_cap) return -1;
      char* frame = at;
      const uint8_t flags = last ? (with_notif ? wire::kLast | wire::kNotifFollows : wire::kLast) : 0;
      at = header(at, flags, last ? nshares : 0, end - p, with_notif ? notif_len : 0, xfer, size);
      for (int64_t i = p; i < end; ++i) {
        put<wire::RunRegionT>(at + wire::kRunRegion, static_cast<wire::RunRegionT>(pieces[i].region));
        put<wire::RunOffsetT>(at + wire::kRunOffset, pieces[i].offset);
        put<wire::RunLengthT>(at + wire::kRunLength, pieces[i].length);
        at += wire::kRunBytes;
      }
      if (!emit(reinterpret_cast<int64_t>(frame), need, false)) return -1;
      for (int64_t i = p; i < end; ++i) {
        if (!emit(pieces[i].addr, pieces[i].length, true)) return -1;
      }
      if (with_notif && notif_len > 0 && !emit(reinterpret_cast<int64_t>(notif), notif_len, false)) return -1;
      share_bytes += size;
      p = end;
    }
    shares[3 * sh + 1] = k - shares[3 * sh];
    if (sealed) {  // the tail's row after the share's (not counted in it), and its run: (region, offset, length)
      const Piece& tail = pieces[p++];
      if (!emit(tail.addr, tail.length, true)) return -1;
      tails[3 * sh] = tail.region, tails[3 * sh + 1] = tail.offset, tails[3 * sh + 2] = tail.length;
      share_bytes += tail.length;
    }
    shares[3 * sh + 2] = share_bytes;
  }
  return nshares;
}

namespace {

// Send every iovec in order (sendmsg, IOV_MAX at a time), resuming partial sends; vec is consumed.
int send_vec(int fd, std::vector<iovec>& vec, int* os_error) {
  size_t i = 0;
  while (i < vec.size()) {
    msghdr msg{};
    msg.msg_iov = vec.data() + i;
    msg.msg_iovlen = std::min<size_t>(vec.size() - i, IOV_MAX);
    const ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      *os_error = errno;
      return errno == EAGAIN || errno == EWOULDBLOCK ? PDKV_LAND_STALLED : PDKV_LAND_EOS;
    }
    size_t left = static_cast<size_t>(sent);
    while (left && i < vec.size()) {  // resume a partial send where it stopped
      if (left >= vec[i].iov_len) {
        left -= vec[i].iov_len;
        ++i;
      } else {
        vec[i].iov_base = static_cast<char*>(vec[i].iov_base) + left;
        vec[i].iov_len -= left;
        left = 0;
      }
    }
    while (i < vec.size() && vec[i].iov_len == 0) ++i;
  }
  return PDKV_OK;
}

}  // namespace

// See kvnet.h.
PDKV_API int pdkv_send_iov(int fd, const int64_t* iov, int64_t n, int* os_error) {
  std::vector<iovec> vec(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    vec[i].iov_base = reinterpret_cast<void*>(iov[2 * i]);
    vec[i].iov_len = static_cast<size_t>(iov[2 * i + 1]);
  }
  return send_vec(fd, vec, os_error);
}

// See kvnet.h.
PDKV_API int pdkv_send_summed(int fd, const int64_t* iov, const int64_t* offsets, int64_t n_send, int64_t n_rows,
                              int64_t unit, int64_t window, uint64_t* acc, int* os_error) {
  if (unit <= 0 || window <= 0 || n_send < 0 || n_rows < n_send) return PDKV_LAND_EARG;
  const pdkv::Cut cut(unit);
  for (int64_t i = 0; i < n_rows; ++i) {  // every payload row at a word of the stream: checked before a byte leaves
    if (offsets[i] >= 0 && (offsets[i] % cut.word || iov[2 * i + 1] % cut.word)) return PDKV_LAND_EARG;
  }
  const int64_t step = std::max(window / cut.word, int64_t{1}) * cut.word;
  uint64_t sum = 0;
  for (int64_t i = n_send; i < n_rows; ++i) {  // rows hashed, not sent (the tail)
    if (offsets[i] >= 0) sum += pdkv::hash_range<false>(cut, 0, offsets[i], reinterpret_cast<const char*>(iov[2 * i]), nullptr, iov[2 * i + 1]);
  }
  // window by window: send up to `step` payload bytes with the headers between, then hash them (the kernel's copy
  // brought them into cache)
  std::vector<iovec> vec;
  std::vector<pdkv::Segment> hashed;  // the window's payload: hashed once sent
  int64_t row = 0, at = 0;
  while (row < n_send) {
    vec.clear();
    hashed.clear();
    int64_t budget = step;
    while (row < n_send && budget > 0 && vec.size() < IOV_MAX) {
      char* base = reinterpret_cast<char*>(iov[2 * row]) + at;
      int64_t take = iov[2 * row + 1] - at;
      if (offsets[row] >= 0) {
        take = std::min(take, budget);
        hashed.push_back({base, offsets[row] + at, take});
        budget -= take;
      }
      vec.push_back(iovec{base, static_cast<size_t>(take)});
      at += take;
      if (at == iov[2 * row + 1]) ++row, at = 0;
    }
    // (not MSG_MORE: on loopback, holding a window's tail for the next made every window slower, see
    // benchmarks/history/2026-11-29-request-round-trip-issue-46.md)
    const int rc = send_vec(fd, vec, os_error);
    if (rc != PDKV_OK) return rc;
    for (const pdkv::Segment& h : hashed) sum += pdkv::hash_range<false>(cut, 0, h.off, h.data, nullptr, h.len);
  }
  *acc = sum;
  return PDKV_OK;
}
