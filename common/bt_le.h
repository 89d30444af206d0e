/* BarqTrain common: the one little-endian codec. Every byte layout BarqTrain defines itself (the
 * resume state in a batch header, token-cache entries, the distributed rendezvous messages) is
 * little-endian and written and read with these, byte by byte, whatever the host's byte order.
 * p points at 2 / 4 / 8 bytes the caller owns; no alignment needed. (Files from elsewhere that
 * are mapped and read in place, GGUF and safetensors, are little-endian by their specs and read
 * in host order: BarqTrain runs on little-endian hosts only, proto/PROTOCOL.md.) */
#ifndef BT_LE_H
#define BT_LE_H
#include <stdint.h>

static inline void bt_put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline uint16_t bt_get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline void bt_put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t bt_get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void bt_put64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint64_t bt_get64(const uint8_t *p) { return (uint64_t)bt_get32(p) | (uint64_t)bt_get32(p + 4) << 32; }

#endif
