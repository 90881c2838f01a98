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
#include <sys/socket.h>
#include <sys/uio.h>
#include <climits>
#include <cerrno>
#include <cstring>
#include <vector>

#include "kvnet.h"
#include "tcpwire.h"

namespace {

namespace wire = pdkv::tcpwire;

struct Piece {
  int64_t share, addr, region, offset, length;
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
                                   int64_t tables_cap, int64_t* iov, int64_t iov_cap, int64_t* shares) {
  if (n_tensors <= 0 || n_ids <= 0 || block_bytes <= 0 || parts <= 0 || max_frame <= 0 || max_runs <= 0) return -2;
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
  // initiator._split: near-equal shares, no piece longer than max_frame
  const int64_t total = n_tensors * n_ids * block_bytes;
  const int64_t share = (total + parts - 1) / parts;
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
  const int64_t nshares = pieces.back().share + 1;
  // Initiator._write_batch, share by share: frames of at most max_runs runs and max_frame bytes
  char* at = tables;
  int64_t k = 0, p = 0;
  const auto emit = [&](int64_t addr, int64_t len) {
    if (k >= iov_cap) return false;
    iov[2 * k] = addr, iov[2 * k + 1] = len, ++k;
    return true;
  };
  for (int64_t sh = 0; sh < nshares; ++sh) {
    shares[3 * sh] = k;
    int64_t share_bytes = 0;
    while (p < static_cast<int64_t>(pieces.size()) && pieces[p].share == sh) {
      int64_t end = p, size = 0;
      while (end < static_cast<int64_t>(pieces.size()) && pieces[end].share == sh && end - p < max_runs &&
             (end == p || size + pieces[end].length <= max_frame)) {
        size += pieces[end++].length;
      }
      const bool last = end == static_cast<int64_t>(pieces.size()) || pieces[end].share != sh;
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
      if (!emit(reinterpret_cast<int64_t>(frame), need)) return -1;
      for (int64_t i = p; i < end; ++i) {
        if (!emit(pieces[i].addr, pieces[i].length)) return -1;
      }
      if (with_notif && notif_len > 0 && !emit(reinterpret_cast<int64_t>(notif), notif_len)) return -1;
      share_bytes += size;
      p = end;
    }
    shares[3 * sh + 1] = k - shares[3 * sh];
    shares[3 * sh + 2] = share_bytes;
  }
  return nshares;
}

// See kvnet.h.
PDKV_API int pdkv_send_iov(int fd, const int64_t* iov, int64_t n, int* os_error) {
  std::vector<iovec> vec(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    vec[i].iov_base = reinterpret_cast<void*>(iov[2 * i]);
    vec[i].iov_len = static_cast<size_t>(iov[2 * i + 1]);
  }
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
