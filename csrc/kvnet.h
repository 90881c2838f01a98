// The tcp channel's socket and landing ABI, in libpdkv_kernels.so beside the
// gather/scatter of kvcopy.h (whose PDKV_API and return codes it shares):
// landing a DATA frame while hashing it (kvland.cpp), the target's frame loop
// and the grant mirror it checks (kvframes.cpp), the initiator's frames of a
// block write and their send (kvsend.cpp). channels/tcp/native.py declares
// these functions for ctypes; the frame format they read and write is
// tcpwire.h, generated from channels/tcp/wire.py.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvcopy.h"

// Landing while hashing (kvland.cpp has the why and the landing table's words).
// desc[r * 5 ..] describes region r: base address, size (0: not registered),
// unit bytes (0: not hashed), landing table address, units.
//
// pdkv_check_runs: whether a DATA frame's run table (the wire's, `nruns`
// entries) holds only runs inside regions of desc, none empty, no two
// overlapping, adding up to `length`: 0 if so, else 1 (the caller then finds
// the run to name).
PDKV_API int pdkv_check_runs(const char* runs, int64_t nruns, const int64_t* desc, int64_t n_desc, int64_t length);
// pdkv_recv_runs receives that frame's payload from the blocking socket fd
// into its runs (checked by pdkv_check_runs against the same desc), the bytes
// of hashed regions in pieces of at most `piece` bytes, and hashes each piece
// into its region's landing table right after it arrived. A receive timeout
// (SO_RCVTIMEO) with no byte is one idle tick; max_idle in a row give up.
// *got is the payload bytes received. Returns PDKV_OK, or one of:
#define PDKV_LAND_EOF 10      // the peer closed the connection
#define PDKV_LAND_STALLED 11  // max_idle ticks without a byte
#define PDKV_LAND_EOS 12      // the socket failed: *os_error is its errno
#define PDKV_LAND_EARG 13     // a bad argument (a bug of the caller)
PDKV_API int pdkv_recv_runs(int fd, const char* runs, int64_t nruns, const int64_t* desc, int64_t n_desc, int64_t piece,
                            int64_t max_idle, int64_t* got, int* os_error);
// The tcp target's DATA frame loop and the grant mirror it checks (kvframes.cpp has the why).
// A grant mirror (pdkv_grants_new/free) holds one Grants object's write
// grants: guarded regions, and per (token, region) its sorted [start, end)
// spans, both written only by Python under its lock, step for step as
// channels/grants.py changes its own: pdkv_grants_add inserts, and
// pdkv_grants_remove subtracts, each of n (region, offset, length) ranges.
// pdkv_grants_begin admits a run table (the wire's, checked by
// pdkv_check_runs) for a token, all runs or none: 0 and *ticket (0: no run in
// a guarded region), or 1; pdkv_grants_end ends a ticket. pdkv_grants_wait
// waits up to timeout_us for every ticket of `token` overlapping n ranges
// (region, offset, length triples) to end: 0, or 1 if one still lands.
PDKV_API void* pdkv_grants_new();
PDKV_API void pdkv_grants_free(void* grants);
PDKV_API void pdkv_grants_guard(void* grants, int64_t region, int on);
PDKV_API void pdkv_grants_add(void* grants, const char* token, int64_t token_len, const int64_t* ranges, int64_t n);
PDKV_API void pdkv_grants_remove(void* grants, const char* token, int64_t token_len, const int64_t* ranges, int64_t n);
PDKV_API int pdkv_grants_begin(void* grants, const char* token, int64_t token_len, const char* runs, int64_t nruns,
                               int64_t* ticket);
PDKV_API void pdkv_grants_end(void* grants, int64_t ticket);
PDKV_API int pdkv_grants_wait(void* grants, const char* token, int64_t token_len, const int64_t* ranges, int64_t n,
                              int64_t timeout_us);
// pdkv_serve_frames serves consecutive DATA frames of the blocking socket fd
// for a connection whose session holds `token`: each checked as
// channels/tcp/lander.py checks it, admitted by the grant mirror, landed and
// hashed as pdkv_recv_runs lands it, under desc while *generation (which
// Python bumps whenever a region is registered or dropped) still equals the
// generation desc was taken at (else the frame is handed back after its run
// table). A frame with LAST that landed is queued in `ring`: ring[0] entries,
// then 4 words each (transfer id, shares, offset of its notification in
// `notifs`, its length or -1 for none). limits: piece, max_idle ticks,
// max_frame_bytes, max_notif_bytes, the payload length before which owed
// completions go out first, desc's generation, the ring's capacity in
// entries, notifs' in bytes (>= max_notif_bytes), whether Python holds ACKs,
// and a wake fd (-1: none): the call's first frame is waited for in poll on
// both, and if the wake fd becomes readable first it returns PDKV_FRAME_IDLE
// (the target's serve pool takes the connection back, channels/tcp/parking.py).
// share: [0] whether the connection is inside a share, [1] that share's
// transfer id, [2] whether hdr holds a header read and not yet served (in
// and out). hdr (tcpwire.h's kHeaderBytes) gets the last header read, table
// (kMaxRuns entries) its run table; io: frames landed, where it stopped in
// the frame (0 header, 1 run table, 2 payload, 3 notification), bytes of that
// part received, bytes of it wanted, errno. Returns (the ring may hold
// completions with any of them):
#define PDKV_FRAME_DRAIN 20   // stopped to have the ring drained (with share[2]: ACKs first), or no frame began
#define PDKV_FRAME_HEADER 21  // a frame it does not take: only its header was read
#define PDKV_FRAME_TABLE 22   // a frame it does not take: its header and run table were read
#define PDKV_FRAME_CLOSED 23  // the peer closed the connection between frames
#define PDKV_FRAME_IDLE 24    // nothing began arriving and the wake fd became readable
// or PDKV_LAND_EOF / PDKV_LAND_STALLED / PDKV_LAND_EOS (a frame cut short).
PDKV_API int pdkv_serve_frames(int fd, void* grants, const char* token, int64_t token_len, const int64_t* desc,
                               int64_t n_desc, const int64_t* generation, const int64_t* limits, uint64_t* share,
                               char* hdr, char* table, int64_t* ring, char* notifs, int64_t* io);
// The tcp initiator's frames of a block write (kvsend.cpp has the why). pdkv_block_frames merges ids into runs
// adjacent on both sides, cuts the bytes of every tensor's runs (tensor by tensor) into at most `parts` shares of
// pieces no longer than max_frame, and frames each share in DATA frames of at most max_runs runs and max_frame
// bytes, the last flagged LAST with the count of shares (and, in share 0 when notif_len >= 0, NOTIF_FOLLOWS with
// the notification's bytes after it): headers and run tables go into `tables`, and each share's buffers in order
// into iov as (address, length) pairs; shares[3 s ...] = (first iovec, iovecs, payload bytes); offsets[k] = iovec
// k's place in the payload stream, -1 for a header or a notification. A sealed write (sealed_tail > 0, no
// notification; its shares end at a checksum word of block_bytes, so they may differ from the Python path's) holds
// back each share's last piece's last sealed_tail bytes (up to a checksum word more; all of a shorter piece): every
// frame goes without LAST, each share's tail iovec follows its rows (not counted in them, its bytes counted in the
// share's payload), and tails[3 s ...] = that tail's (region, offset, length), for the caller's LAST frame of the
// share. Returns the number of shares, -1 if tables_cap or iov_cap is too small, -2 for a bad argument, -3 for a
// sealed write whose pieces are not whole checksum words.
PDKV_API int64_t pdkv_block_frames(const int64_t* local_bases, const int64_t* remote_regions, int64_t n_tensors,
                                   const int64_t* local_ids, const int64_t* remote_ids, int64_t n_ids,
                                   int64_t block_bytes, int64_t parts, int64_t max_frame, int64_t max_runs,
                                   uint64_t xfer, const char* notif, int64_t notif_len, char* tables,
                                   int64_t tables_cap, int64_t* iov, int64_t iov_cap, int64_t* shares,
                                   int64_t* offsets, int64_t sealed_tail, int64_t* tails);
// pdkv_send_iov sends n (address, length) buffers in order on the blocking socket fd (SO_SNDTIMEO), resuming
// partial sends: PDKV_OK, PDKV_LAND_STALLED (a send timed out with nothing sent) or PDKV_LAND_EOS (*os_error).
PDKV_API int pdkv_send_iov(int fd, const int64_t* iov, int64_t n, int* os_error);
// pdkv_send_summed sends rows [0, n_send) of iov as pdkv_send_iov does, hashing the payload rows among [0, n_rows)
// (offsets[k] >= 0: their place in the stream) into *acc, the chunk checksum's accumulator in units of `unit`: the
// rows past n_send first (hashed, not sent), then `window` payload bytes at a time right after they are sent.
// PDKV_LAND_EARG (nothing sent) when a payload row is not whole words of the stream.
PDKV_API int pdkv_send_summed(int fd, const int64_t* iov, const int64_t* offsets, int64_t n_send, int64_t n_rows,
                              int64_t unit, int64_t window, uint64_t* acc, int* os_error);
// pdkv_landing_reset zeroes the landing table entries of every unit that (region, offset, length) ranges[3 i ...]
// touch, for the regions desc (n_desc rows of kvland.cpp's descriptor) hashes as they land; other ranges are skipped.
// For a grant to a new owner: nothing landed under an earlier grant counts (channels/landing.py LandingSums.reset).
PDKV_API void pdkv_landing_reset(const int64_t* desc, int64_t n_desc, const int64_t* ranges, int64_t n);

// pdkv_grid_ranges writes the (region, offset, length) ranges of a block grid's runs into out[3 (i n_runs + k) ...]:
// every region of regions[0, n_regions) in turn, each run (offset, length) of runs[2 k ...] in turn (the order of
// channels/grants.py BlockGrid.ranges), so a grant of blocks over a KV buffer's tensors costs Python one call
// however many tensors it has. out holds 3 n_regions n_runs words.
PDKV_API void pdkv_grid_ranges(const int64_t* regions, int64_t n_regions, const int64_t* runs, int64_t n_runs, int64_t* out);
// The checksum accumulator of blocks ids[] (each checked against [0, num_blocks)) of every region in turn (bases[t],
// its landing table tables[t]; units of block_bytes), as pdkv_checksum_blocks_cpu gives it: from each block's landing
// entry where it landed exactly once in hashed pieces, else read from memory (*reread counts those blocks).
PDKV_API int pdkv_landed_blocks(const int64_t* bases, const int64_t* tables, int64_t n_bases, const int64_t* ids, int64_t n_ids,
                                int64_t num_blocks, int64_t block_bytes, uint64_t* out, int64_t* reread, char* err, size_t err_len);
