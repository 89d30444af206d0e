/* TensorBoard scalar event files, written without TensorFlow.
 *
 * Format (tensorflow/core/lib/io/record_writer.cc, tensorboard/summary/writer/record_writer.py):
 * a sequence of TFRecords, each
 *   uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data[length] |
 *   uint32 masked_crc32c(data)
 * with masked_crc = ((crc >> 15) | (crc << 17)) + 0xa282ead8 and crc32c the Castagnoli CRC
 * (polynomial 0x1EDC6F41, reflected 0x82F63B78). Each data is a serialised tensorflow.Event
 * protocol buffer (tensorboard/compat/proto/event.proto): field 1 wall_time (double), field 2
 * step (int64), and either field 3 file_version (string, "brain.Event:2" in the first record) or
 * field 5 summary (Summary: repeated field 1 Value { field 1 tag (string), field 2 simple_value
 * (float) }). The protobuf wire encoding of these few fields is written directly (varint keys,
 * fixed64 / fixed32 / length-delimited values); tests/py read the files back with TensorBoard's
 * own EventAccumulator. */
#ifndef BT_TRAINER_TB_EVENTS_H
#define BT_TRAINER_TB_EVENTS_H
#include <stddef.h>
#include <stdint.h>

typedef struct bt_tb_writer bt_tb_writer;

/* CRC-32C (Castagnoli) of n bytes, starting from crc (0 for a fresh CRC). */
uint32_t bt_crc32c(uint32_t crc, const void *p, size_t n);

/* Create dir/events.out.tfevents.<unix time>.<hostname>.<pid>.0 and write the file_version
 * record. *out owned by the caller (bt_tb_close). Errors: BT_ERR_IO, BT_ERR_NOMEM. */
int bt_tb_open(bt_tb_writer **out, const char *dir);
/* Append one scalar event (tag: UTF-8, < 256 bytes) at `step` and `wall_time` (unix seconds),
 * flushed. Errors: BT_ERR_IO, BT_ERR_INVALID (tag too long). */
int bt_tb_scalar(bt_tb_writer *w, const char *tag, int64_t step, double wall_time, float value);
/* The file's path (owned by w). */
const char *bt_tb_path(const bt_tb_writer *w);
void bt_tb_close(bt_tb_writer *w);

#endif
