//! Event protobufs in TFRecord frames: written one frame at a time, read back with every
//! checksum checked.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use prost::Message as _;

use crate::crc32c::masked;

/// The version the first event of a file names (TensorBoard reads files of this version).
pub const FILE_VERSION: &str = "brain.Event:2";

/// The largest frame a reader takes: a step's scalars are a few kilobytes, so anything near
/// this is damage, not data.
const MAX_FRAME: u64 = 16 << 20;

/// The largest event file read back whole.
const MAX_FILE: u64 = 1 << 30;

#[derive(Debug, thiserror::Error)]
pub enum TensorBoardError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The file is not a sequence of whole, intact frames of events.
    #[error("{path}: damaged at byte {offset}: {reason}")]
    Damaged { path: PathBuf, offset: u64, reason: String },
}

/// One tagged value of a step (`train/loss`, `experts/L0/e3`, …).
#[derive(Debug, Clone, PartialEq)]
pub struct Scalar {
    pub tag: String,
    pub value: f32,
}

/// tensorflow.Event, the fields scalars use.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// tensorflow.Summary.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// tensorflow.Summary.Value: a tag and (here) its simple value. The value is a oneof, so a 0 is
/// written, not left out as a plain proto3 field's default would be.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(oneof = "Value", tags = "2")]
    value: Option<Value>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Value {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
}

/// One frame: length, its masked CRC-32C, the bytes, theirs.
fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked(data).to_le_bytes());
    out
}

/// The frame of the event that begins a file, at `wall_time`.
pub fn version_frame(wall_time: f64) -> Vec<u8> {
    frame(&Event { wall_time, step: 0, what: Some(What::FileVersion(FILE_VERSION.into())) }.encode_to_vec())
}

/// The frame of `scalars` at `step`, `wall_time`; a value that is not finite is left out
/// (TensorBoard would draw it as a gap in any case).
pub fn scalars_frame(step: u64, wall_time: f64, scalars: &[(&str, f64)]) -> Vec<u8> {
    let value = scalars
        .iter()
        .filter(|(_, v)| v.is_finite())
        .map(|&(tag, v)| SummaryValue { tag: tag.to_string(), value: Some(Value::SimpleValue(v as f32)) })
        .collect();
    frame(&Event { wall_time, step: step.min(i64::MAX as u64) as i64, what: Some(What::Summary(Summary { value })) }.encode_to_vec())
}

/// Appends events to one file of a log directory. Each frame goes to the file whole (one
/// write), so a reader — or a killed run — sees whole frames, or a tail it can tell is cut.
pub struct EventWriter {
    file: std::fs::File,
    path: PathBuf,
}

impl EventWriter {
    /// A new file `name` in `dir` (made if missing), begun with the version event.
    pub fn create(dir: &Path, name: &str, wall_time: f64) -> Result<Self, TensorBoardError> {
        let io = |path: &Path, source| TensorBoardError::Io { path: path.to_path_buf(), source };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new().create_new(true).write(true).open(&path).map_err(|e| io(&path, e))?;
        let mut w = EventWriter { file, path };
        w.write(&version_frame(wall_time))?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `scalars` of `step` at `wall_time` (seconds since the Unix epoch).
    pub fn scalars(&mut self, step: u64, wall_time: f64, scalars: &[(&str, f64)]) -> Result<(), TensorBoardError> {
        self.write(&scalars_frame(step, wall_time, scalars))
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), TensorBoardError> {
        self.file.write_all(bytes).map_err(|source| TensorBoardError::Io { path: self.path.clone(), source })
    }
}

/// A step's scalars as read back.
#[derive(Debug, Clone, PartialEq)]
pub struct StepScalars {
    pub step: i64,
    pub wall_time: f64,
    pub scalars: Vec<Scalar>,
}

/// The events of the file at `path`: its version, then each event's scalars in order. Every
/// frame's checksums are checked; a frame cut short at the end (a run killed mid-write) ends the
/// file, anything else damaged is an error naming the byte.
pub fn read_events(path: &Path) -> Result<(String, Vec<StepScalars>), TensorBoardError> {
    let io = |source| TensorBoardError::Io { path: path.to_path_buf(), source };
    let size = std::fs::metadata(path).map_err(io)?.len();
    if size > MAX_FILE {
        return Err(TensorBoardError::Damaged { path: path.into(), offset: 0, reason: format!("{size} bytes, more than {MAX_FILE}") });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    let bad = |offset: usize, reason: String| TensorBoardError::Damaged { path: path.into(), offset: offset as u64, reason };
    let (mut version, mut steps, mut at) = (None, Vec::new(), 0usize);
    while at < bytes.len() {
        let Some(head) = bytes.get(at..at + 12) else { break };
        let len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        if u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) != masked(&head[..8]) {
            return Err(bad(at, "the length's checksum does not match".into()));
        }
        if len > MAX_FRAME {
            return Err(bad(at, format!("a frame of {len} bytes")));
        }
        let (start, end) = (at + 12, at + 12 + len as usize);
        let Some(data) = bytes.get(start..end) else { break };
        let Some(crc) = bytes.get(end..end + 4) else { break };
        if u32::from_le_bytes(crc.try_into().expect("4 bytes")) != masked(data) {
            return Err(bad(start, "the event's checksum does not match".into()));
        }
        let event = Event::decode(data).map_err(|e| bad(start, format!("not an event: {e}")))?;
        match event.what {
            Some(What::FileVersion(v)) => version = Some(v),
            Some(What::Summary(s)) => {
                let scalars = s
                    .value
                    .into_iter()
                    .filter_map(|v| match v.value {
                        Some(Value::SimpleValue(value)) => Some(Scalar { tag: v.tag, value }),
                        None => None,
                    })
                    .collect();
                steps.push(StepScalars { step: event.step, wall_time: event.wall_time, scalars });
            }
            None => {}
        }
        at = end + 4;
    }
    let version = version.ok_or_else(|| bad(0, format!("no file version event (expected {FILE_VERSION})")))?;
    Ok((version, steps))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lazarus-tensorboard-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn scalars_come_back_as_written_and_zero_is_a_value() {
        let dir = temp("round-trip");
        let mut w = EventWriter::create(&dir, "events.out.tfevents.1.test", 1000.0).unwrap();
        w.scalars(1, 1001.5, &[("train/loss", 5.25), ("train/aux_loss", 0.0), ("bad", f64::NAN)]).unwrap();
        w.scalars(2, 1002.5, &[("train/loss", 4.5)]).unwrap();
        let (version, steps) = read_events(w.path()).unwrap();
        assert_eq!(version, FILE_VERSION);
        assert_eq!(steps.len(), 2);
        assert_eq!((steps[0].step, steps[0].wall_time), (1, 1001.5));
        let tags: Vec<(&str, f32)> = steps[0].scalars.iter().map(|s| (s.tag.as_str(), s.value)).collect();
        assert_eq!(tags, vec![("train/loss", 5.25), ("train/aux_loss", 0.0)], "NaN left out, 0 kept");
        assert!(EventWriter::create(&dir, "events.out.tfevents.1.test", 0.0).is_err(), "never written over");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A frame cut at the end (a run killed mid-write) ends the file; a flipped byte anywhere
    /// is an error naming where, never a panic or a wrong value.
    #[test]
    fn a_cut_tail_ends_the_file_and_damage_is_named() {
        let dir = temp("damage");
        std::fs::create_dir_all(&dir).unwrap();
        let mut bytes = version_frame(1.0);
        bytes.extend(scalars_frame(1, 2.0, &[("a", 1.0)]));
        let whole = bytes.len();
        bytes.extend(scalars_frame(2, 3.0, &[("a", 2.0)]));
        let path = dir.join("events");
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        assert_eq!(read_events(&path).unwrap().1.len(), 1, "the cut frame is not read");
        for i in 0..whole {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            std::fs::write(&path, &b).unwrap();
            match read_events(&path) {
                Err(TensorBoardError::Damaged { .. }) => {}
                Ok((_, steps)) => panic!("byte {i} flipped, read {steps:?}"),
                Err(e) => panic!("{e}"),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
