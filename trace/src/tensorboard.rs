//! TensorBoard event files: scalars and text that `tensorboard --logdir`
//! plots, written without TensorFlow or a protobuf library.
//!
//! An event file is a sequence of TFRecords, each holding one serialized
//! `tensorboard.Event` protobuf message. [`EventWriter`] writes the first
//! record TensorBoard expects (`file_version = "brain.Event:2"`), then one
//! event per [`scalar`](EventWriter::scalar) or [`text`](EventWriter::text)
//! call; [`file_name`] gives the conventional file name (TensorBoard reads
//! every file whose name contains `tfevents` in a run's folder).
//! [`read_records`] splits a file back into its records, checking both
//! checksums of each; [`write_record`] frames any payload.
//!
//! # Why hand-written
//! This crate depends on `serde` alone and compiles for `wasm32`, and the
//! handful of messages involved are small: the framing (CRC32C included)
//! and the protobuf encoding are a page of code here. What is written is
//! the canonical encoding — fields in number order, proto3 defaults left
//! out — byte for byte what TensorBoard's Python package produces for the
//! same messages (the integration tests check this against the
//! `tensorboard` package's own reader and serializer).
//!
//! # Format
//! A record is
//!
//! | bytes | content |
//! |---|---|
//! | 8 | length `n` of the data, `u64` little-endian |
//! | 4 | masked CRC32C of those 8 bytes, `u32` little-endian |
//! | `n` | the data: one serialized `Event` |
//! | 4 | masked CRC32C of the data, `u32` little-endian |
//!
//! where CRC32C is the Castagnoli CRC (reflected polynomial `0x82F63B78`)
//! and the mask is `((crc >> 15) | (crc << 17)) + 0xa282ead8` (wrapping).
//!
//! The messages (field numbers from `tensorboard/compat/proto`):
//!
//! ```text
//! Event          { double wall_time = 1; int64 step = 2;
//!                  oneof what { string file_version = 3; Summary summary = 5; } }
//! Summary        { repeated Value value = 1; }
//! Summary.Value  { string tag = 1; SummaryMetadata metadata = 9;
//!                  oneof value { float simple_value = 2; TensorProto tensor = 8; } }
//! SummaryMetadata{ PluginData plugin_data = 1; }
//! PluginData     { string plugin_name = 1; bytes content = 2; }
//! TensorProto    { DataType dtype = 1; TensorShapeProto tensor_shape = 2;
//!                  repeated bytes string_val = 8; }     // DT_STRING = 7
//! ```
//!
//! A scalar is a `simple_value` (an `f32`), which TensorBoard's scalars
//! dashboard plots; a text is what TensorBoard's own `text_pb` writes: a
//! scalar (rank 0) `DT_STRING` tensor with the text plugin's metadata.
//!
//! # Example
//! ```
//! use weft_trace::tensorboard::{EventWriter, file_name, read_records};
//!
//! let name = file_name(1_700_000_000, "node-1", 4242);
//! assert_eq!(name, "events.out.tfevents.1700000000.node-1.4242.weft");
//!
//! // Any `io::Write`: a `BufWriter<File>` named `run/tb/<name>` in a run.
//! let mut w = EventWriter::new(Vec::new(), 1_700_000_000.0)?;
//! w.scalar("train/loss", 1, 3.25, 1_700_000_001.0)?;
//! w.scalar("train/loss", 2, f64::NAN, 1_700_000_002.0)?; // written as NaN
//! w.text("config", 0, "lr = 3e-4", 1_700_000_000.5)?;
//! w.flush()?;
//! let bytes = w.into_inner();
//!
//! // The file_version record, then one record per call.
//! let records = read_records(&bytes)?;
//! assert_eq!(records.len(), 4);
//! assert!(records[0].ends_with(b"brain.Event:2"));
//!
//! // A flipped bit is caught, naming where.
//! let mut bad = bytes.clone();
//! bad[60] ^= 1;
//! let err = read_records(&bad).unwrap_err();
//! assert_eq!((err.record(), err.record_offset()), (1, 40)); // the second record
//! assert!(err.to_string().starts_with("TFRecord 1 at byte 40: data checksum mismatch"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::io::{self, Write};

/// The `file_version` of the first event of every file: the version of the
/// `Event` format that TensorBoard expects.
pub const FILE_VERSION: &str = "brain.Event:2";

/// The `plugin_name` of text summaries (TensorBoard's text dashboard).
pub const TEXT_PLUGIN: &str = "text";

/// `DataType::DT_STRING` of `tensorboard/compat/proto/types.proto`.
const DT_STRING: u64 = 7;

/// Bytes of a record's framing: length, its CRC, and the data's CRC.
const FRAMING_BYTES: usize = 8 + 4 + 4;

// ------------------------------------------------------------------ CRC32C

/// The byte-wise table of CRC32C (Castagnoli, reflected polynomial
/// `0x82F63B78`), computed at compile time.
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// CRC32C of `data`.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = CRC32C_TABLE[((crc ^ u32::from(b)) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// The masked CRC32C that TFRecords store (masking keeps a CRC of data
/// that itself holds CRCs from being degenerate).
fn masked_crc32c(data: &[u8]) -> u32 {
    // ((crc >> 15) | (crc << 17)) + 0xa282ead8
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

// --------------------------------------------------------------- TFRecords

/// Appends one TFRecord holding `data` to `buf`.
fn frame_record(buf: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    buf.reserve(FRAMING_BYTES + data.len());
    buf.extend_from_slice(&len);
    buf.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    buf.extend_from_slice(data);
    buf.extend_from_slice(&masked_crc32c(data).to_le_bytes());
}

/// Writes `data` as one TFRecord (length, its masked CRC32C, the data, its
/// masked CRC32C), in a single `write_all`.
///
/// # Errors
/// The error of `out`'s `write_all`.
pub fn write_record<W: Write>(out: &mut W, data: &[u8]) -> io::Result<()> {
    let mut buf = Vec::new();
    frame_record(&mut buf, data);
    out.write_all(&buf)
}

/// What is wrong with a TFRecord, found by [`read_records`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordError {
    /// The bytes end inside a record (a file still being written, or cut
    /// short).
    Truncated {
        /// Index of the record, from 0.
        record: usize,
        /// Byte offset of the record's start.
        offset: usize,
        /// Bytes the record needs from its start (as far as known: the
        /// framing's 12 bytes when the length itself is cut, else the
        /// whole record).
        needed: u64,
        /// Bytes left from the record's start.
        available: usize,
    },
    /// The length's checksum does not match: the 8 length bytes or the 4
    /// checksum bytes after them are corrupt.
    LengthCrc {
        /// Index of the record, from 0.
        record: usize,
        /// Byte offset of the record's start (its length field).
        offset: usize,
        /// The masked CRC32C stored in the file.
        stored: u32,
        /// The masked CRC32C of the length bytes as read.
        computed: u32,
    },
    /// The data's checksum does not match: the data or the 4 checksum
    /// bytes after it are corrupt.
    DataCrc {
        /// Index of the record, from 0.
        record: usize,
        /// Byte offset of the record's start.
        offset: usize,
        /// Byte offset of the record's data (`offset + 12`).
        data_offset: usize,
        /// Length of the data in bytes.
        len: usize,
        /// The masked CRC32C stored in the file.
        stored: u32,
        /// The masked CRC32C of the data as read.
        computed: u32,
    },
}

impl RecordError {
    /// Index of the offending record, from 0.
    pub fn record(&self) -> usize {
        match *self {
            Self::Truncated { record, .. }
            | Self::LengthCrc { record, .. }
            | Self::DataCrc { record, .. } => record,
        }
    }

    /// Byte offset of the start of the offending record: every record
    /// before it is intact.
    pub fn record_offset(&self) -> usize {
        match *self {
            Self::Truncated { offset, .. }
            | Self::LengthCrc { offset, .. }
            | Self::DataCrc { offset, .. } => offset,
        }
    }
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Truncated {
                record,
                offset,
                needed,
                available,
            } => write!(
                f,
                "TFRecord {record} at byte {offset}: truncated, {available} bytes left of the \
                 {needed} it needs (a file still being written, or cut short)"
            ),
            Self::LengthCrc {
                record,
                offset,
                stored,
                computed,
            } => write!(
                f,
                "TFRecord {record} at byte {offset}: length checksum mismatch (stored \
                 {stored:#010x}, computed {computed:#010x}): bytes {offset}..{} are corrupt",
                offset + 12
            ),
            Self::DataCrc {
                record,
                offset,
                data_offset,
                len,
                stored,
                computed,
            } => write!(
                f,
                "TFRecord {record} at byte {offset}: data checksum mismatch (stored \
                 {stored:#010x}, computed {computed:#010x}): bytes {data_offset}..{} are corrupt",
                data_offset + len + 4
            ),
        }
    }
}

impl std::error::Error for RecordError {}

/// Splits `bytes` (a whole TFRecord file, such as an event file) into its
/// records' data, checking the length's and the data's checksums of each.
///
/// # Errors
/// A [`RecordError`] naming the first bad record and its byte offset: cut
/// short ([`Truncated`](RecordError::Truncated)) or failing a checksum.
/// The records before [`RecordError::record_offset`] are intact: a reader
/// of a file still being written can take those and retry later.
pub fn read_records(bytes: &[u8]) -> Result<Vec<Vec<u8>>, RecordError> {
    let mut records = Vec::new();
    let mut offset = 0;
    while offset < bytes.len() {
        let record = records.len();
        let rest = &bytes[offset..];
        if rest.len() < 12 {
            return Err(RecordError::Truncated {
                record,
                offset,
                needed: 12,
                available: rest.len(),
            });
        }
        let len_bytes = &rest[..8];
        let stored = le_u32(&rest[8..12]);
        let computed = masked_crc32c(len_bytes);
        if stored != computed {
            return Err(RecordError::LengthCrc {
                record,
                offset,
                stored,
                computed,
            });
        }
        let len = len_bytes
            .iter()
            .rev()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
        let needed = len.saturating_add(FRAMING_BYTES as u64);
        let total = match usize::try_from(needed) {
            Ok(n) if n <= rest.len() => n,
            _ => {
                return Err(RecordError::Truncated {
                    record,
                    offset,
                    needed,
                    available: rest.len(),
                });
            }
        };
        let data = &rest[12..total - 4];
        let stored = le_u32(&rest[total - 4..total]);
        let computed = masked_crc32c(data);
        if stored != computed {
            return Err(RecordError::DataCrc {
                record,
                offset,
                data_offset: offset + 12,
                len: data.len(),
                stored,
                computed,
            });
        }
        records.push(data.to_vec());
        offset += total;
    }
    Ok(records)
}

/// The `u32` in the first 4 bytes of `b`, little-endian.
fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

// ---------------------------------------------------------------- protobuf

/// Protobuf wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

fn put_tag(buf: &mut Vec<u8>, field: u32, wire: u32) {
    put_varint(buf, u64::from((field << 3) | wire));
}

/// A length-delimited field: string, bytes or embedded message.
fn put_bytes(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_tag(buf, field, LEN);
    put_varint(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

/// A serialized `Event`: `summary` holding one `Summary.Value`, or
/// `file_version`.
fn event(wall_time: f64, step: i64, what: What<'_>) -> Vec<u8> {
    let mut ev = Vec::with_capacity(64);
    // proto3 leaves out fields at their default (canonical encoding);
    // -0.0 is not the default, bit for bit.
    if wall_time.to_bits() != 0 {
        put_tag(&mut ev, 1, FIXED64);
        ev.extend_from_slice(&wall_time.to_le_bytes());
    }
    if step != 0 {
        put_tag(&mut ev, 2, VARINT);
        // int64: two's complement, as a u64 varint
        put_varint(&mut ev, step as u64);
    }
    match what {
        What::FileVersion(v) => put_bytes(&mut ev, 3, v.as_bytes()),
        What::Value(value) => {
            let mut summary = Vec::with_capacity(value.len() + 4);
            put_bytes(&mut summary, 1, &value);
            put_bytes(&mut ev, 5, &summary);
        }
    }
    ev
}

/// The `what` of an [`event`].
enum What<'a> {
    FileVersion(&'a str),
    /// A serialized `Summary.Value`.
    Value(Vec<u8>),
}

/// `Summary.Value { tag, simple_value }`.
fn scalar_value(tag: &str, value: f32) -> Vec<u8> {
    let mut v = Vec::with_capacity(tag.len() + 8);
    put_bytes(&mut v, 1, tag.as_bytes());
    // in a oneof: written even when 0
    put_tag(&mut v, 2, FIXED32);
    v.extend_from_slice(&value.to_le_bytes());
    v
}

/// `Summary.Value { tag, tensor: scalar DT_STRING, metadata: text plugin }`.
fn text_value(tag: &str, text: &str) -> Vec<u8> {
    let mut tensor = Vec::with_capacity(text.len() + 8);
    put_tag(&mut tensor, 1, VARINT);
    put_varint(&mut tensor, DT_STRING);
    // tensor_shape: an empty TensorShapeProto (no dims: rank 0), written
    // explicitly as TensorBoard's `text_pb` does
    put_bytes(&mut tensor, 2, &[]);
    put_bytes(&mut tensor, 8, text.as_bytes());

    let mut plugin_data = Vec::with_capacity(8);
    put_bytes(&mut plugin_data, 1, TEXT_PLUGIN.as_bytes());
    // content: the text plugin's TextPluginData { version: 0 } serializes
    // to nothing, and empty bytes are left out
    let mut metadata = Vec::with_capacity(16);
    put_bytes(&mut metadata, 1, &plugin_data);

    let mut v = Vec::with_capacity(tag.len() + tensor.len() + metadata.len() + 8);
    put_bytes(&mut v, 1, tag.as_bytes());
    put_bytes(&mut v, 8, &tensor);
    put_bytes(&mut v, 9, &metadata);
    v
}

// ------------------------------------------------------------------ writer

/// The conventional name of an event file:
/// `events.out.tfevents.<wall_time_secs>.<host>.<pid>.weft`.
///
/// TensorBoard reads every file of a folder whose name contains `tfevents`,
/// in name order; the rest of the name keeps files of several writers (and
/// restarts) apart. Characters of `host` other than ASCII letters, digits,
/// `-`, `_` and `.` become `_`, so the name is always one path component.
pub fn file_name(wall_time_secs: u64, host: &str, pid: u32) -> String {
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("events.out.tfevents.{wall_time_secs}.{host}.{pid}.weft")
}

/// Writes a TensorBoard event file: scalars and texts, one TFRecord each.
///
/// Times are seconds since the Unix epoch (`wall_time`, as TensorBoard's
/// relative and wall-time axes use), steps are optimizer steps. Each call
/// writes its whole record with one `write_all`; wrap a file in a
/// [`BufWriter`](std::io::BufWriter) and call [`flush`](Self::flush) when
/// TensorBoard should see what was written (after each logged step, say).
/// TensorBoard reads a file while it grows and waits for a record cut short.
///
/// See the [module docs](self) for an example.
#[derive(Debug)]
pub struct EventWriter<W: Write> {
    out: W,
    /// Reused for each record.
    buf: Vec<u8>,
}

impl<W: Write> EventWriter<W> {
    /// A writer that first writes the `file_version` event
    /// ([`FILE_VERSION`]) at `wall_time` to `out`.
    ///
    /// # Errors
    /// The error of writing to `out`.
    pub fn new(out: W, wall_time: f64) -> io::Result<Self> {
        let mut w = Self {
            out,
            buf: Vec::new(),
        };
        w.write_event(&event(wall_time, 0, What::FileVersion(FILE_VERSION)))?;
        Ok(w)
    }

    /// Writes the scalar `value` of series `tag` at `step`, as an `f32`
    /// `simple_value` (rounded to nearest; NaN and infinities are written
    /// as such, and a finite value beyond `f32`'s range becomes infinite).
    ///
    /// # Errors
    /// [`InvalidInput`](io::ErrorKind::InvalidInput) if `step` exceeds
    /// `i64::MAX` (TensorBoard's steps are `int64`), else the error of
    /// writing to the output.
    pub fn scalar(&mut self, tag: &str, step: u64, value: f64, wall_time: f64) -> io::Result<()> {
        let step = checked_step(step)?;
        self.write_event(&event(
            wall_time,
            step,
            What::Value(scalar_value(tag, value as f32)),
        ))
    }

    /// Writes `text` (Markdown, as TensorBoard's text dashboard renders it)
    /// of series `tag` at `step`: a rank-0 string tensor with the text
    /// plugin's metadata, as TensorBoard's own `text_pb` writes.
    ///
    /// # Errors
    /// [`InvalidInput`](io::ErrorKind::InvalidInput) if `step` exceeds
    /// `i64::MAX`, else the error of writing to the output.
    pub fn text(&mut self, tag: &str, step: u64, text: &str, wall_time: f64) -> io::Result<()> {
        let step = checked_step(step)?;
        self.write_event(&event(wall_time, step, What::Value(text_value(tag, text))))
    }

    /// Flushes the output.
    ///
    /// # Errors
    /// The error of the output's `flush`.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// The output, borrowed.
    pub fn get_ref(&self) -> &W {
        &self.out
    }

    /// The output, given back (not flushed: call [`flush`](Self::flush)
    /// first where that matters).
    pub fn into_inner(self) -> W {
        self.out
    }

    fn write_event(&mut self, event: &[u8]) -> io::Result<()> {
        self.buf.clear();
        frame_record(&mut self.buf, event);
        self.out.write_all(&self.buf)
    }
}

fn checked_step(step: u64) -> io::Result<i64> {
    i64::try_from(step).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "step {step} exceeds TensorBoard's largest step, {} (steps are int64)",
                i64::MAX
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn crc32c_known_vectors() {
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b"a"), 0xC1D0_4330);
        // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of 0xff, ascending
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        let descending: Vec<u8> = (0..32).rev().collect();
        assert_eq!(crc32c(&descending), 0x113F_DB5C);
    }

    #[test]
    fn masked_crc_matches_tensorboard() {
        // masked_crc32c of tensorboard.compat.tensorflow_stub
        assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
        assert_eq!(masked_crc32c(b""), 0xa282_ead8);
        let data = hex(
            "09000000000000004010ac022a1d0a1b0a056e6f746573420808071200420268694a080a060a0474657874",
        );
        assert_eq!(
            masked_crc32c(&(data.len() as u64).to_le_bytes()),
            0x4bc3_1b86
        );
        assert_eq!(masked_crc32c(&data), 0xd8cf_0dd5);
    }

    #[test]
    fn varints() {
        let enc = |v: u64| {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            b
        };
        assert_eq!(enc(0), [0x00]);
        assert_eq!(enc(1), [0x01]);
        assert_eq!(enc(127), [0x7f]);
        assert_eq!(enc(128), [0x80, 0x01]);
        assert_eq!(enc(300), [0xac, 0x02]);
        assert_eq!(enc(16_384), [0x80, 0x80, 0x01]);
        assert_eq!(
            enc(i64::MAX as u64),
            [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]
        );
        assert_eq!(
            enc(u64::MAX),
            [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
        let mut b = Vec::new();
        put_tag(&mut b, 9, LEN);
        assert_eq!(b, [0x4a]);
    }

    /// The expected bytes are `Event(...).SerializeToString()` of the
    /// `tensorboard` package (2.21), the text from
    /// `summary_v2.text_pb("notes", "hi")`.
    #[test]
    fn events_match_tensorboards_serialization() {
        assert_eq!(
            event(1.5, 0, What::FileVersion(FILE_VERSION)),
            hex("09000000000000f83f1a0d627261696e2e4576656e743a32")
        );
        assert_eq!(
            event(1.5, 3, What::Value(scalar_value("loss", 2.5))),
            hex("09000000000000f83f10032a0d0a0b0a046c6f73731500002040")
        );
        assert_eq!(
            event(2.0, 300, What::Value(text_value("notes", "hi"))),
            hex(
                "09000000000000004010ac022a1d0a1b0a056e6f746573420808071200420268694a080a060a0474657874"
            )
        );
        // defaults left out, but a zero simple_value kept (it is in a oneof)
        assert_eq!(
            event(0.0, 0, What::Value(scalar_value("a", 0.0))),
            hex("2a0a0a080a01611500000000")
        );
    }

    #[test]
    fn records_round_trip() {
        let payloads: Vec<Vec<u8>> =
            vec![vec![], b"x".to_vec(), vec![7u8; 300], (0..=255).collect()];
        let mut file = Vec::new();
        for p in &payloads {
            write_record(&mut file, p).unwrap();
        }
        assert_eq!(
            file.len(),
            payloads
                .iter()
                .map(|p| p.len() + FRAMING_BYTES)
                .sum::<usize>()
        );
        assert_eq!(read_records(&file).unwrap(), payloads);
        assert_eq!(read_records(&[]).unwrap(), Vec::<Vec<u8>>::new());
    }

    #[test]
    fn every_corrupted_byte_is_caught_naming_its_record() {
        let mut file = Vec::new();
        write_record(&mut file, b"first").unwrap();
        let second = file.len();
        write_record(&mut file, b"second record").unwrap();
        for i in 0..file.len() {
            let mut bad = file.clone();
            bad[i] ^= 0x10;
            let err = read_records(&bad).unwrap_err();
            let (record, offset) = if i < second { (0, 0) } else { (1, second) };
            assert_eq!(
                (err.record(), err.record_offset()),
                (record, offset),
                "byte {i}: {err}"
            );
            let in_length = i - offset < 12;
            match err {
                RecordError::LengthCrc { .. } => assert!(in_length, "byte {i}"),
                RecordError::DataCrc { data_offset, .. } => {
                    assert!(!in_length, "byte {i}");
                    assert_eq!(data_offset, offset + 12);
                    assert!(
                        err.to_string().contains(&format!("at byte {offset}")),
                        "{err}"
                    );
                }
                RecordError::Truncated { .. } => panic!("byte {i}: {err}"),
            }
        }
    }

    #[test]
    fn truncation_is_named() {
        let mut file = Vec::new();
        write_record(&mut file, b"first").unwrap();
        let second = file.len();
        write_record(&mut file, b"second").unwrap();
        for cut in second + 1..file.len() {
            let err = read_records(&file[..cut]).unwrap_err();
            let needed = if cut - second < 12 { 12 } else { 6 + 16 };
            assert_eq!(
                err,
                RecordError::Truncated {
                    record: 1,
                    offset: second,
                    needed,
                    available: cut - second
                }
            );
        }
        // a huge length with a valid checksum is a truncation, not a panic
        let mut huge = Vec::new();
        let len = u64::MAX.to_le_bytes();
        huge.extend_from_slice(&len);
        huge.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        let err = read_records(&huge).unwrap_err();
        assert!(
            matches!(
                err,
                RecordError::Truncated {
                    needed: u64::MAX,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn writer_writes_version_then_events() {
        let mut w = EventWriter::new(Vec::new(), 1.5).unwrap();
        w.scalar("loss", 3, 2.5, 1.5).unwrap();
        w.text("notes", 300, "hi", 2.0).unwrap();
        w.scalar("nan", 4, f64::NAN, 1.5).unwrap();
        let err = w.scalar("loss", u64::MAX, 1.0, 1.5).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("18446744073709551615"), "{err}");
        let records = read_records(&w.into_inner()).unwrap();
        assert_eq!(records.len(), 4);
        assert_eq!(records[0], event(1.5, 0, What::FileVersion(FILE_VERSION)));
        assert_eq!(
            records[1],
            event(1.5, 3, What::Value(scalar_value("loss", 2.5)))
        );
        assert_eq!(
            records[2],
            event(2.0, 300, What::Value(text_value("notes", "hi")))
        );
        // NaN's f32 bits, the last 4 bytes of the value
        assert!(records[3].ends_with(&f32::NAN.to_le_bytes()));
    }

    #[test]
    fn file_names() {
        assert_eq!(
            file_name(1_700_000_000, "gpu-node.cluster", 7),
            "events.out.tfevents.1700000000.gpu-node.cluster.7.weft"
        );
        assert_eq!(
            file_name(1, "a/b\\c d", 2),
            "events.out.tfevents.1.a_b_c_d.2.weft"
        );
        assert_eq!(file_name(1, "..", 2), "events.out.tfevents.1....2.weft");
        assert!(file_name(0, "", 0).contains("tfevents"));
    }
}

// ------------------------------------------------------- a run's logs

/// One value of a run's logs as TensorBoard shows it: a point of a
/// scalar series or a text.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    /// A point of the scalar series `tag`.
    Scalar {
        /// The series, e.g. `train/loss`.
        tag: String,
        /// The optimizer step.
        step: u64,
        /// The value (written as an `f32`).
        value: f64,
    },
    /// A text (Markdown) of series `tag`.
    Text {
        /// The series, e.g. `health`.
        tag: String,
        /// The optimizer step.
        step: u64,
        /// The text.
        text: String,
    },
}

impl Entry {
    fn scalar(tag: &str, step: u64, value: f64) -> Self {
        Entry::Scalar {
            tag: tag.to_owned(),
            step,
            value,
        }
    }
}

impl<W: Write> EventWriter<W> {
    /// Writes `entry` at `wall_time`.
    ///
    /// # Errors
    /// As [`scalar`](Self::scalar) and [`text`](Self::text).
    pub fn entry(&mut self, entry: &Entry, wall_time: f64) -> io::Result<()> {
        match entry {
            Entry::Scalar { tag, step, value } => self.scalar(tag, *step, *value, wall_time),
            Entry::Text { tag, step, text } => self.text(tag, *step, text, wall_time),
        }
    }
}

/// The scalars of a line of `metrics.jsonl` that is a step's record, one
/// for each of its numbers (the optional ones where present), under the
/// tags `train/loss`, `train/lr`, `train/grad_norm`, `train/loss_scale`,
/// `perf/tokens_per_s`, `perf/mfu`, `moe/max_vio` and `memory/rss_bytes`.
///
/// ```
/// use weft_trace::MetricsRecord;
/// use weft_trace::tensorboard::{Entry, record_entries};
/// let r = MetricsRecord { step: 3, loss: 2.5, lr: 1e-3, grad_norm: 0.5, tokens_per_s: 900.0,
///                         time_s: 1.0, loss_scale: None, mfu: Some(0.4), max_vio: None,
///                         rss_bytes: None };
/// let e = record_entries(&r);
/// assert_eq!(e.len(), 5);
/// assert_eq!(e[0], Entry::Scalar { tag: "train/loss".into(), step: 3, value: 2.5 });
/// ```
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn record_entries(r: &crate::MetricsRecord) -> Vec<Entry> {
    let s = r.step;
    let mut out = vec![
        Entry::scalar("train/loss", s, r.loss),
        Entry::scalar("train/lr", s, r.lr),
        Entry::scalar("train/grad_norm", s, r.grad_norm),
        Entry::scalar("perf/tokens_per_s", s, r.tokens_per_s),
    ];
    let optional = [
        ("perf/mfu", r.mfu),
        ("train/loss_scale", r.loss_scale),
        ("moe/max_vio", r.max_vio),
        ("memory/rss_bytes", r.rss_bytes.map(|b| b as f64)),
    ];
    for (tag, v) in optional {
        out.extend(v.map(|v| Entry::scalar(tag, s, v)));
    }
    out
}

/// What a line of `metrics.jsonl` that is an event becomes: an evaluation
/// the scalar `eval/val_loss`; a health event (a skipped update, an fp16
/// overflow, a loss spike) a text of series `health` naming it with its
/// figures.
#[must_use]
pub fn event_entries(e: &crate::MetricsEvent) -> Vec<Entry> {
    use crate::MetricsEventKind as K;
    let text = match &e.kind {
        K::Eval { val_loss, .. } => return vec![Entry::scalar("eval/val_loss", e.step, *val_loss)],
        K::Skip { loss, grad_norm } => {
            format!("update skipped: loss {loss}, gradient norm {grad_norm} (non-finite)")
        }
        K::Overflow {
            loss_scale,
            next_loss_scale,
            ..
        } => format!(
            "fp16 gradients overflowed at loss scale {loss_scale}: update skipped, scale now {next_loss_scale}"
        ),
        K::Spike { loss, median, .. } => {
            format!("loss spike {loss} against a rolling median of {median}")
        }
        K::Unknown => return Vec::new(),
    };
    vec![Entry::Text {
        tag: "health".into(),
        step: e.step,
        text: format!("step {}: {text}", e.step),
    }]
}

/// What a line of `expert_load.jsonl` becomes: its layer's MaxVio
/// ((max − mean)/mean of the tokens per expert), the fraction of
/// assignments dropped and the router entropy, under
/// `moe/layer<L>/max_vio`, `moe/layer<L>/dropped` and
/// `moe/layer<L>/router_entropy`.
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn expert_entries(r: &crate::ExpertLoadRecord) -> Vec<Entry> {
    let (s, l) = (r.step, r.layer);
    let mut out = Vec::new();
    let n = r.num_experts();
    if n > 0 && r.kept() > 0 {
        let mean = r.kept() as f64 / n as f64;
        let max = r.tokens_per_expert.iter().copied().max().unwrap_or(0) as f64;
        out.push(Entry::scalar(
            &format!("moe/layer{l}/max_vio"),
            s,
            max / mean - 1.0,
        ));
    }
    out.push(Entry::scalar(
        &format!("moe/layer{l}/dropped"),
        s,
        r.drop_fraction(),
    ));
    if let Some(h) = r.router_entropy {
        out.push(Entry::scalar(&format!("moe/layer{l}/router_entropy"), s, h));
    }
    out
}

// ------------------------------------------------------- a run folder

/// Seconds since the Unix epoch.
fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A run folder's TensorBoard event file: opened with what the run's logs
/// already hold, then written as the run goes on. A write that fails is
/// kept and reported by [`RunBoard::check`], so a caller that cannot
/// handle errors where it writes (an observer) still learns of it.
#[derive(Debug)]
pub struct RunBoard {
    out: EventWriter<io::BufWriter<std::fs::File>>,
    path: std::path::PathBuf,
    failed: Option<io::Error>,
}

impl RunBoard {
    /// Starts a new event file in `run_dir` (its earlier event files
    /// removed: a resumed run's logs are rewritten too) with the text
    /// `config` (the job's TOML) and every number the run's
    /// `metrics.jsonl` and `expert_load.jsonl` hold for steps up to
    /// `step` ([`record_entries`], [`event_entries`], [`expert_entries`]).
    ///
    /// # Errors
    /// Listing, removing, creating or writing a file.
    pub fn open(run_dir: &std::path::Path, config: &str, step: u64) -> io::Result<Self> {
        for e in std::fs::read_dir(run_dir)?.flatten() {
            if e.file_name().to_string_lossy().contains("tfevents") {
                std::fs::remove_file(e.path())?;
            }
        }
        let t = now();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let path = run_dir.join(file_name(t as u64, "weft", std::process::id()));
        let file = io::BufWriter::new(std::fs::File::create(&path)?);
        let mut board = Self {
            out: EventWriter::new(file, t)?,
            path,
            failed: None,
        };
        let text = format!("```toml\n{config}\n```");
        board.write(&[Entry::Text {
            tag: "config".into(),
            step: 0,
            text,
        }]);
        let read = |name| {
            crate::input::read_to_string(run_dir.join(name), crate::input::LOG_BYTES)
                .unwrap_or_default()
        };
        for line in read("metrics.jsonl").lines() {
            let entries = match serde_json::from_str::<crate::MetricsEvent>(line) {
                Ok(e) if e.step <= step => event_entries(&e),
                Ok(_) => continue,
                Err(_) => match serde_json::from_str::<crate::MetricsRecord>(line) {
                    Ok(r) if r.step <= step => record_entries(&r),
                    _ => continue,
                },
            };
            board.write(&entries);
        }
        for line in read("expert_load.jsonl").lines() {
            if let Ok(r) = serde_json::from_str::<crate::ExpertLoadRecord>(line)
                && r.step <= step
            {
                board.write(&expert_entries(&r));
            }
        }
        board.check()?;
        Ok(board)
    }

    /// Writes `entries` now (a failure is kept for [`RunBoard::check`]).
    pub fn write(&mut self, entries: &[Entry]) {
        let t = now();
        for e in entries {
            if self.failed.is_none()
                && let Err(err) = self.out.entry(e, t)
            {
                self.failed = Some(err);
            }
        }
    }

    /// Flushes the file (TensorBoard then sees what was written).
    ///
    /// # Errors
    /// The first write that failed since the last check, else the flush's.
    pub fn check(&mut self) -> io::Result<()> {
        match self.failed.take() {
            Some(e) => Err(e),
            None => self.out.flush(),
        }
    }

    /// The event file.
    #[must_use]
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}
