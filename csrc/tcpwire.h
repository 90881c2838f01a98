// Generated from channels/tcp/wire.py by `python -m pdkv.channels.tcp.wire > csrc/tcpwire.h`: do not edit.
// The tcp channel's frame format as the native loops read and write it (tests/test_wire_header.py).
#pragma once

#include <cstdint>
#include <cstring>

namespace pdkv::tcpwire {

constexpr char kMagic[2] = {'P', 'K'};
constexpr uint8_t kVersion = 3;
constexpr uint8_t kData = 3;  // the frame type the native loops send and land
constexpr uint8_t kLast = 1, kNotifFollows = 2;  // DATA flags
constexpr int64_t kMaxStreams = 64;  // a transfer's shares
constexpr int64_t kMaxRuns = 4096;  // runs per DATA frame

// A frame header (<2sBBBxHIIQQQ): its size, each field's byte offset and each number's type.
constexpr int64_t kHeaderBytes = 40;
constexpr int64_t kHeaderMagic = 0;
constexpr int64_t kHeaderVersion = 2;
using HeaderVersionT = uint8_t;
constexpr int64_t kHeaderType = 3;
using HeaderTypeT = uint8_t;
constexpr int64_t kHeaderFlags = 4;
using HeaderFlagsT = uint8_t;
constexpr int64_t kHeaderShares = 6;
using HeaderSharesT = uint16_t;
constexpr int64_t kHeaderAux = 8;
using HeaderAuxT = uint32_t;
constexpr int64_t kHeaderNotif = 12;
using HeaderNotifT = uint32_t;
constexpr int64_t kHeaderXfer = 16;
using HeaderXferT = uint64_t;
constexpr int64_t kHeaderOffset = 24;
using HeaderOffsetT = uint64_t;
constexpr int64_t kHeaderLength = 32;
using HeaderLengthT = uint64_t;

// A run table entry (<IQQ): its size, each field's byte offset and type.
constexpr int64_t kRunBytes = 20;
constexpr int64_t kRunRegion = 0;
using RunRegionT = uint32_t;
constexpr int64_t kRunOffset = 4;
using RunOffsetT = uint64_t;
constexpr int64_t kRunLength = 12;
using RunLengthT = uint64_t;

// Run `k` of a run table, each field read at its offset and width.
inline void read_run(const char* table, int64_t k, RunRegionT* region, RunOffsetT* offset,
                     RunLengthT* length) {
  const char* at = table + k * kRunBytes;
  std::memcpy(region, at + kRunRegion, sizeof *region);
  std::memcpy(offset, at + kRunOffset, sizeof *offset);
  std::memcpy(length, at + kRunLength, sizeof *length);
}

}  // namespace pdkv::tcpwire
