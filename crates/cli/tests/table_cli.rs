//! Parquet and Arrow files of a Hugging Face dataset as training data, from the command line:
//! pyarrow and `datasets` wrote the files (`crates/model/tests/fixtures/{parquet,arrow}/make.py`).

mod common;

use std::path::Path;
use std::process::Output;

use common::{dir, lazarus, log as log_of};

fn fixture(name: &str) -> String {
    let format = if name.ends_with(".arrow") { "arrow" } else { "parquet" };
    format!("{}/../model/tests/fixtures/{format}/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `lazarus train` of the tiny model on the Parquet or Arrow `data`, its token caches under
/// `cache`.
fn train_on(data: &str, cache: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--data", data, "--data-cache", cache.to_str().unwrap()];
    args.extend(&common::tiny_model("2")[..14]);
    args.extend(extra);
    lazarus(&args)
}

/// The token caches made under `cache`.
fn caches(cache: &Path) -> usize {
    std::fs::read_dir(cache).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".idx")).count()
}

/// `steps` steps of `train` uninterrupted, then half of them saved and the run resumed to
/// `steps` in `d`: each step once, with the uninterrupted run's losses. The two first runs'
/// stderr.
fn resumes_exactly(d: &Path, steps: u64, train: impl Fn(&[&str]) -> Output) -> (String, String) {
    let (whole, part, ck) = (d.join("whole.jsonl"), d.join("part.jsonl"), d.join("ck"));
    let (all, half) = (steps.to_string(), (steps / 2).to_string());
    let out = train(&["--steps", &all, "--no-save", "--json-log", whole.to_str().unwrap()]);
    let first = stderr(&out);
    assert!(out.status.success(), "{first}");
    let out = train(&["--steps", &half, "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    let second = stderr(&out);
    assert!(out.status.success(), "{second}");
    let out =
        lazarus(&["train", "--resume", "--steps", &all, "--checkpoint-dir", ck.to_str().unwrap(), "--json-log", part.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (a, b) = (log_of(&whole).0, log_of(&part).0);
    assert_eq!(a.len() as u64, steps);
    assert_eq!(a.iter().map(|s| s.0).collect::<Vec<_>>(), b.iter().map(|s| s.0).collect::<Vec<_>>());
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: {x} uninterrupted, {y} resumed");
    }
    (first, second)
}

/// A text column (the format found from the extension) is read once into the token cache and
/// found there by the next run; a run stopped and resumed reads the windows the uninterrupted
/// run reads; worker processes open the cache too; `lazarus eval` reads Parquet; a column of
/// token ids trains as it is.
#[test]
fn parquet_text_and_token_ids_train_resume_exactly_and_are_cached_once() {
    let d = dir("parquet");
    let cache = d.join("cache");
    let data = fixture("train.parquet");
    let (first, second) = resumes_exactly(&d, 4, |extra| train_on(&data, &cache, extra));
    assert!(first.contains("1 Parquet file(s)") && first.contains("1200 rows of 3 row groups read into"), "{first}");
    assert!(second.contains("from the cache"), "{second}");
    let out = train_on(&data, &cache, &["--steps", "2", "--no-save", "--workers", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(caches(&cache), 1, "one cache for one file, column and tokenizer");
    let ck = d.join("ck");
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let out =
        lazarus(&["eval", "--checkpoint", ck.join(latest.trim()).to_str().unwrap(), "--data", &fixture("text.parquet"), "--windows", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Token ids: a list<int32> column named, ids below the vocabulary.
    let extra = ["--data-column", "input_ids", "--vocab-size", "1000", "--steps", "2", "--no-save"];
    let out = train_on(&fixture("train_ids.parquet"), &cache, &extra);
    let err = stderr(&out);
    assert!(out.status.success() && err.contains("400 rows"), "{err}");
}

#[test]
fn a_parquet_column_that_is_not_there_or_not_data_is_refused_by_name() {
    let d = dir("parquet-bad");
    let cache = d.join("cache");
    let data = fixture("train_ids.parquet");
    let run = |extra: &[&str]| {
        let mut args = vec!["--steps", "1", "--no-save"];
        args.extend(extra);
        let out = train_on(&data, &cache, &args);
        (out.status.success(), stderr(&out))
    };
    let (ok, err) = run(&["--data-column", "labels", "--vocab-size", "1000"]);
    assert!(!ok && err.contains("no column `labels` (it has input_ids, attention_mask)"), "{err}");
    let (ok, err) = run(&["--data-column", "input_ids", "--vocab-size", "500"]);
    assert!(!ok && err.contains("outside the vocabulary of 500"), "{err}");
    let (ok, err) = run(&["--data-column", "input_ids", "--vocab-size", "1000", "--data-format", "text"]);
    assert!(!ok && err.contains("--data-column names a column of Parquet or Arrow files"), "{err}");
}

/// `--data-weights` blends Parquet files as it blends Megatron datasets (a token cache each): a
/// run stopped and resumed draws the windows the uninterrupted run draws.
#[test]
fn blended_parquet_files_resume_exactly() {
    let d = dir("parquet-blend");
    let cache = d.join("cache");
    let data = format!("{},{}", fixture("train.parquet"), fixture("text.parquet"));
    let (first, _) = resumes_exactly(&d, 6, |extra| {
        let mut args = vec!["--data-weights", "3,1"];
        args.extend(extra);
        train_on(&data, &cache, &args)
    });
    assert!(first.contains("2 Parquet file(s) blended by weight"), "{first}");
    assert_eq!(caches(&cache), 2, "a cache for each file of a blend");
}

/// An Arrow stream (the format found from the extension) trains exactly as the Parquet file of
/// the same rows — the same tokens, so the same losses step by step — resumes exactly, is cached
/// once beside the Parquet file's cache, and `lazarus eval` reads `datasets`' own files; a
/// Parquet file named as Arrow is refused saying so.
#[test]
fn an_arrow_dataset_trains_as_its_parquet_twin_and_resumes_exactly() {
    let d = dir("arrow");
    let cache = d.join("cache");
    let data = fixture("train.arrow");
    let (first, second) = resumes_exactly(&d, 4, |extra| train_on(&data, &cache, extra));
    assert!(first.contains("1 Arrow file(s)") && first.contains("1200 rows of 3 record batches read into"), "{first}");
    assert!(second.contains("from the cache"), "{second}");
    let twin = d.join("twin.jsonl");
    let out = train_on(&fixture("train.parquet"), &cache, &["--steps", "4", "--no-save", "--json-log", twin.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(log_of(&twin).0, log_of(&d.join("whole.jsonl")).0, "the same losses from the Parquet file of the same rows");
    assert_eq!(caches(&cache), 2, "a cache for each format's file");
    let ck = d.join("ck");
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let checkpoint = ck.join(latest.trim());
    for (file, extra) in [("hf_saved_text.arrow", None), ("hf_map_ids.arrow", Some("input_ids"))] {
        let path = fixture(file);
        let mut args = vec!["eval", "--checkpoint", checkpoint.to_str().unwrap(), "--data", &path, "--windows", "1"];
        args.extend(extra.iter().flat_map(|c| ["--data-column", c]));
        let out = lazarus(&args);
        assert!(out.status.success(), "{file}: {}", stderr(&out));
    }
    let out = train_on(&fixture("train.parquet"), &cache, &["--steps", "1", "--no-save", "--data-format", "arrow"]);
    let err = stderr(&out);
    assert!(!out.status.success() && err.contains("a Parquet file, not Arrow: read it with --data-format parquet"), "{err}");
}
