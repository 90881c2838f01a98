// Generated from channels/tcp/wire.py by `python -m pdkv.channels.tcp.wire > csrc/tcpwire.h`: do not edit.
// The tcp channel's frame format as the native loops read and write it (tests/test_wire_header.py).
#pragma once

#include <cstdint>

namespace pdkv::tcpwire {

constexpr char kMagic[2] = {'P', 'K'};
constexpr uint8_t kVersion = 3;
constexpr uint8_t kData = 3;  // the frame type the native loops send and land
constexpr uint8_t kLast = 1, kNotifFollows = 2;  // DATA flags
constexpr int64_t kMaxStreams = 64;  // a transfer's shares
constexpr int64_t kMaxRuns = 4096;  // runs per DATA frame

// A frame header (<2sBBBxHIIQQQ): its size and each field's byte offset.
constexpr int64_t kHeaderBytes = 40;
constexpr int64_t kHeaderMagic = 0;
constexpr int64_t kHeaderVersion = 2;
constexpr int64_t kHeaderType = 3;
constexpr int64_t kHeaderFlags = 4;
constexpr int64_t kHeaderShares = 6;
constexpr int64_t kHeaderAux = 8;
constexpr int64_t kHeaderNotif = 12;
constexpr int64_t kHeaderXfer = 16;
constexpr int64_t kHeaderOffset = 24;
constexpr int64_t kHeaderLength = 32;

// A run table entry (<IQQ): its size and each field's byte offset.
constexpr int64_t kRunBytes = 20;
constexpr int64_t kRunRegion = 0;
constexpr int64_t kRunOffset = 4;
constexpr int64_t kRunLength = 12;

}  // namespace pdkv::tcpwire
