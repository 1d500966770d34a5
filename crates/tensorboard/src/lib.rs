//! TensorBoard event files: what `tensorboard --logdir` shows as a run's scalars.
//!
//! A file is a sequence of TFRecord frames — `u64` length, its masked CRC-32C, the bytes, their
//! masked CRC-32C, all little-endian — each holding one `Event` protobuf: the first names the
//! file's version (`brain.Event:2`), every later one a step's summary of tagged scalars. The
//! messages are TensorFlow's (`tensorflow/core/util/event.proto`, `summary.proto`), written here
//! with only the fields scalars use. [`EventWriter`] appends them (each frame whole, flushed when
//! asked); [`read_events`] reads a file back, checking every checksum — what the tests and
//! `lazarus report` use. The tests hold the bytes to a file TensorBoard's own reader read
//! (`tests/fixtures/`, with the script that read it).

mod crc32c;
mod record;

pub use record::{read_events, scalars_frame, version_frame, EventWriter, Scalar, StepScalars, TensorBoardError, FILE_VERSION};

/// The name of an event file TensorBoard finds in a log directory: `events.out.tfevents.` then
/// the time it was begun (seconds), the host, and what tells two of the same second apart.
pub fn event_file_name(unix_s: u64, host: &str, pid: u32) -> String {
    let host: String = host.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' }).collect();
    format!("events.out.tfevents.{unix_s}.{host}.{pid}.lazarus")
}
