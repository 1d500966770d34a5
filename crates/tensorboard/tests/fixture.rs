//! Our event files as TensorBoard reads them: the bytes we write for fixed inputs are those of
//! `fixtures/events.out.tfevents.fixture`, which TensorBoard's own readers read back
//! (`fixtures/read_back.py` wrote `fixtures/read_back.json`): every event, step, wall time, tag
//! and value, and the scalars dashboard's series.

use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A step's number, wall time and scalars.
type Step = (u64, f64, Vec<(&'static str, f64)>);

/// The inputs: a version event, then three steps of a few tags (a 0, a tag that appears
/// later, one left out as NaN).
fn written() -> (Vec<u8>, Vec<Step>) {
    let steps = vec![
        (1, 1_795_900_001.25, vec![("train/loss", 5.5), ("train/aux_loss", 0.0), ("expert_load/layer0/expert1", 0.25)]),
        (2, 1_795_900_002.5, vec![("train/loss", 4.75), ("train/aux_loss", 0.015625), ("expert_load/layer0/expert1", 0.375)]),
        (3, 1_795_900_003.75, vec![("train/loss", 4.125), ("eval/loss", 4.5), ("train/grad_norm", f64::NAN)]),
    ];
    let mut bytes = lazarus_tensorboard::version_frame(1_795_900_000.0);
    for (step, wall, scalars) in &steps {
        bytes.extend(lazarus_tensorboard::scalars_frame(*step, *wall, scalars));
    }
    (bytes, steps)
}

#[test]
fn tensorboard_reads_what_we_write() {
    let (bytes, steps) = written();
    let path = fixtures().join("events.out.tfevents.fixture");
    if std::env::var_os("LAZARUS_WRITE_FIXTURES").is_some() {
        std::fs::write(&path, &bytes).unwrap();
    }
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "our bytes are the fixture's (LAZARUS_WRITE_FIXTURES=1 writes it anew)");
    let read: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("read_back.json")).unwrap()).unwrap();
    let events = read["events"].as_array().unwrap();
    assert_eq!(events.len(), 1 + steps.len());
    assert_eq!(events[0]["file_version"], lazarus_tensorboard::FILE_VERSION);
    for ((step, wall, scalars), e) in steps.iter().zip(&events[1..]) {
        assert_eq!(e["step"].as_u64(), Some(*step));
        assert_eq!(e["wall_time"].as_f64(), Some(*wall));
        let seen = e["scalars"].as_object().unwrap();
        let finite: Vec<_> = scalars.iter().filter(|(_, v)| v.is_finite()).collect();
        assert_eq!(seen.len(), finite.len(), "step {step}: {seen:?}");
        for (tag, v) in finite {
            assert_eq!(seen[*tag].as_f64(), Some(*v), "step {step} {tag}");
        }
    }
    // The dashboard's series: train/loss over the three steps, eval/loss at step 3.
    let dash = &read["scalars_dashboard"];
    assert_eq!(dash["train/loss"], serde_json::json!([[1, 5.5], [2, 4.75], [3, 4.125]]));
    assert_eq!(dash["eval/loss"], serde_json::json!([[3, 4.5]]));
    // And our own reader agrees.
    let (version, back) = lazarus_tensorboard::read_events(&path).unwrap();
    assert_eq!((version.as_str(), back.len()), (lazarus_tensorboard::FILE_VERSION, 3));
}
