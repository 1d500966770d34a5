//! `lazarus report RUN_DIR`: one self-contained HTML page of a run, finished or running, from
//! what its directory holds — the loss (and held-out loss), tokens/s and MoE bytes over steps,
//! each expert's share of its layer's tokens over steps, every move of the job (losses,
//! recoveries, joins, drains, rebalances, rollbacks) with what it cost, and the run's settings.
//! Nothing in it is fetched from elsewhere: its pictures are inline SVG, it has no script.

mod chart;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use chart::{escape, line_chart, load_heatmap, Line};
use clap::Args;

/// The largest log read (a million steps of a large model's loads are a few hundred MB).
const MAX_LOG_BYTES: u64 = 2 << 30;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// The run's directory (what `lazarus train` names in its summary: runs/DATE-TIME), or any
    /// directory with a --json-log in it.
    run: PathBuf,
    /// The run's JSON log (default: RUN/log.jsonl).
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// Where the page goes (default: RUN/report.html).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

/// One step as the log has it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepLine {
    step: u64,
    loss: f64,
    aux_loss: f64,
    tokens_per_s: f64,
    moe_wire_bytes: Option<f64>,
    /// Each expert's share of its layer's tokens, per MoE layer.
    shares: Vec<Vec<f64>>,
}

/// What the page shows of a run.
#[derive(Debug, Default)]
pub(crate) struct RunRecord {
    steps: Vec<StepLine>,
    /// (step, loss, perplexity) of each evaluation on held-out data.
    evals: Vec<(u64, f64, f64)>,
    /// Each move of the job, as logged.
    moves: Vec<serde_json::Value>,
}

pub fn run_report(args: &ReportArgs) -> Result<()> {
    if !args.run.is_dir() {
        bail!("invalid RUN_DIR: {} is not a directory (a run's, as `lazarus train` names it in its summary)", args.run.display());
    }
    let log = args.log.clone().unwrap_or_else(|| args.run.join(crate::train::args::RUN_LOG));
    let record = read_log(&log)?;
    let settings = std::fs::read_to_string(args.run.join(crate::train::args::RUN_CONFIG)).ok();
    let latest = lazarus_model::checkpoint::held_checkpoint(&args.run);
    let page = page(&args.run, &record, settings.as_deref(), latest.as_deref());
    let out = args.out.clone().unwrap_or_else(|| args.run.join("report.html"));
    let tmp = out.with_extension("html.tmp");
    std::fs::write(&tmp, page).and_then(|_| std::fs::rename(&tmp, &out)).with_context(|| format!("writing {}", out.display()))?;
    crate::io::println(&format!(
        "{}: {} steps, {} evaluations, {} moves",
        out.display(),
        record.steps.len(),
        record.evals.len(),
        record.moves.len()
    ))
}

/// The run's JSON log: its step lines, evaluations and moves. A line that is not JSON is an
/// error naming it (a line cut at the end — a run killed while writing it — ends the log).
pub(crate) fn read_log(path: &Path) -> Result<RunRecord> {
    let size = std::fs::metadata(path).with_context(|| format!("the run's log {}", path.display()))?.len();
    if size > MAX_LOG_BYTES {
        bail!("{}: {size} bytes, more than the {MAX_LOG_BYTES} a report reads", path.display());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut record = RunRecord::default();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let v: serde_json::Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => break,
            Err(e) => bail!("{} line {}: not JSON ({e})", path.display(), i + 1),
        };
        match v.get("event").and_then(|e| e.as_str()) {
            Some("eval") => record.evals.push((
                v["step"].as_u64().unwrap_or(0),
                v["loss"].as_f64().unwrap_or(f64::NAN),
                v["perplexity"].as_f64().unwrap_or(f64::NAN),
            )),
            Some(_) => record.moves.push(v),
            None => record.steps.extend(step_line(&v)),
        }
    }
    Ok(record)
}

fn step_line(v: &serde_json::Value) -> Option<StepLine> {
    let shares = v["expert_load"]
        .as_array()?
        .iter()
        .map(|layer| {
            let counts: Vec<f64> = layer.as_array().map(|c| c.iter().map(|x| x.as_f64().unwrap_or(0.0)).collect()).unwrap_or_default();
            let total = counts.iter().sum::<f64>().max(1.0);
            counts.into_iter().map(|c| c / total).collect()
        })
        .collect();
    Some(StepLine {
        step: v["step"].as_u64()?,
        loss: v["loss"].as_f64().unwrap_or(f64::NAN),
        aux_loss: v["aux_loss"].as_f64().unwrap_or(f64::NAN),
        tokens_per_s: v["tokens_per_s"].as_f64().unwrap_or(f64::NAN),
        moe_wire_bytes: v["moe_wire_bytes"].as_f64(),
        shares,
    })
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px;max-width:960px;color:#222}h1{font-size:22px}\
h2{font-size:17px;margin-top:28px}table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;\
text-align:right}th{background:#f3f3f3}td.l,th.l{text-align:left}.chart{display:block;margin:8px 0}.chart .title{font-size:14px}\
.chart text{font-size:11px}.tick{fill:#444}pre{background:#f6f6f6;padding:10px;font-size:12px;overflow:auto}.note{color:#555;font-size:13px}";

/// The page of a run.
pub(crate) fn page(run: &Path, r: &RunRecord, settings: Option<&str>, latest: Option<&str>) -> String {
    let name = run.file_name().map_or_else(|| run.display().to_string(), |n| n.to_string_lossy().to_string());
    let mut out = String::new();
    let _ = write!(out, "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Lazarus run {}</title>", escape(&name));
    let _ = write!(out, "<style>{STYLE}</style></head><body><h1>Lazarus run {}</h1>", escape(&name));
    let _ = write!(out, "<p class=\"note\">{}</p>", escape(&summary_line(r, latest)));
    let marks: Vec<f64> = r.moves.iter().filter_map(|m| m["step"].as_f64()).collect();
    let at = |f: fn(&StepLine) -> f64| r.steps.iter().map(|s| (s.step as f64, f(s))).collect::<Vec<_>>();
    let mut losses = vec![Line { name: "loss", color: "#1f77b4", points: at(|s| s.loss) }];
    if !r.evals.is_empty() {
        losses.push(Line { name: "held-out loss", color: "#ff7f0e", points: r.evals.iter().map(|e| (e.0 as f64, e.1)).collect() });
    }
    out.push_str("<h2>Training</h2>");
    out.push_str(&line_chart("loss (nats per token) over steps; moves marked", &losses, &marks));
    out.push_str(&line_chart(
        "auxiliary (load-balancing) loss",
        &[Line { name: "aux loss", color: "#9467bd", points: at(|s| s.aux_loss) }],
        &marks,
    ));
    out.push_str(&line_chart("tokens per second", &[Line { name: "tokens/s", color: "#2ca02c", points: at(|s| s.tokens_per_s) }], &marks));
    if r.steps.iter().any(|s| s.moe_wire_bytes.is_some()) {
        let wire = Line { name: "MB a step", color: "#8c564b", points: at(|s| s.moe_wire_bytes.unwrap_or(f64::NAN) / 1e6) };
        out.push_str(&line_chart("MoE all-to-all bytes between workers (MB a step)", &[wire], &marks));
    }
    out.push_str("<h2>Expert loads</h2>");
    let layers = r.steps.iter().map(|s| s.shares.len()).max().unwrap_or(0);
    let steps: Vec<u64> = r.steps.iter().map(|s| s.step).collect();
    for l in 0..layers {
        let shares: Vec<Vec<f64>> = r.steps.iter().map(|s| s.shares.get(l).cloned().unwrap_or_default()).collect();
        out.push_str(&load_heatmap(&format!("MoE layer {l}: each expert's share of the tokens"), &steps, &shares));
    }
    out.push_str(&moves_table(&r.moves));
    if !r.evals.is_empty() {
        out.push_str("<h2>Held-out evaluations</h2><table><tr><th>step</th><th>loss</th><th>perplexity</th></tr>");
        for (step, loss, ppl) in &r.evals {
            let _ = write!(out, "<tr><td>{step}</td><td>{loss:.4}</td><td>{ppl:.2}</td></tr>");
        }
        out.push_str("</table>");
    }
    if let Some(s) = settings {
        let _ = write!(out, "<h2>Settings</h2><pre>{}</pre>", escape(s));
    }
    out.push_str("</body></html>\n");
    out
}

fn summary_line(r: &RunRecord, latest: Option<&str>) -> String {
    let last = r.steps.last();
    let mean_tps = r.steps.iter().map(|s| s.tokens_per_s).filter(|t| t.is_finite()).sum::<f64>() / r.steps.len().max(1) as f64;
    format!(
        "{} steps logged (last: step {}, loss {:.4}); {:.0} tokens/s on average; {} moves; latest checkpoint: {}",
        r.steps.len(),
        last.map_or(0, |s| s.step),
        last.map_or(f64::NAN, |s| s.loss),
        mean_tps,
        r.moves.len(),
        latest.unwrap_or("none")
    )
}

/// Every move of the job with what it cost.
fn moves_table(moves: &[serde_json::Value]) -> String {
    let mut out = String::from("<h2>Events</h2>");
    if moves.is_empty() {
        out.push_str("<p class=\"note\">none: no worker lost, joined or left, no rebalance or rollback</p>");
        return out;
    }
    out.push_str(
        "<table><tr><th>step</th><th class=\"l\">what</th><th>epoch</th><th class=\"l\">lost</th><th class=\"l\">joined</th>\
         <th>workers after</th><th>detect s</th><th>plan s</th><th>transfer s</th><th>MB moved</th><th>rebuild s</th>\
         <th>recovery s</th><th>experts restored</th></tr>",
    );
    let ids =
        |v: &serde_json::Value| v.as_array().map(|a| a.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")).unwrap_or_default();
    let secs = |v: &serde_json::Value| v.as_f64().map_or("–".to_string(), |s| format!("{s:.3}"));
    for m in moves {
        let _ = write!(
            out,
            "<tr><td>{}</td><td class=\"l\">{}</td><td>{}</td><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{:.2}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            m["step"],
            escape(m["cause"].as_str().or(m["event"].as_str()).unwrap_or("?")),
            m["epoch"],
            escape(&ids(&m["lost"])),
            escape(&ids(&m["joined"])),
            m["workers"],
            secs(&m["detect_s"]),
            secs(&m["plan_s"]),
            secs(&m["transfer_s"]),
            m["transfer_bytes"].as_f64().unwrap_or(0.0) / 1e6,
            secs(&m["rebuild_s"]),
            secs(&m["recovery_s"]),
            m["restored"].as_array().map_or(0, Vec::len)
        );
    }
    out.push_str("</table>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_reads_as_steps_evaluations_and_moves_and_a_cut_last_line_ends_it() {
        let dir = std::env::temp_dir().join(format!("lazarus-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("log.jsonl");
        let text = concat!(
            r#"{"step":1,"loss":5.0,"aux_loss":0.1,"tokens":32,"tokens_per_s":100.0,"elapsed_s":0.1,"expert_load":[[1,3],[2,2]]}"#,
            "\n",
            r#"{"event":"reconfiguration","epoch":1,"cause":"reconfigure","lost":[1],"joined":[],"step":1,"recovery_s":0.2,"workers":3}"#,
            "\n",
            r#"{"event":"eval","step":1,"loss":5.5,"perplexity":244.7,"windows":4,"tokens":64}"#,
            "\n",
            r#"{"step":2,"loss":4.0,"aux_l"#
        );
        std::fs::write(&log, text).unwrap();
        let r = read_log(&log).unwrap();
        assert_eq!((r.steps.len(), r.evals.len(), r.moves.len()), (1, 1, 1));
        assert_eq!(r.steps[0].shares, vec![vec![0.25, 0.75], vec![0.5, 0.5]]);
        let html = page(&dir, &r, Some("steps = 2 # <b>"), Some("step-00000001"));
        assert!(html.starts_with("<!DOCTYPE html>") && html.ends_with("</html>\n"));
        assert!(html.contains("<td class=\"l\">reconfigure</td>") && html.contains("<td>0.200</td>"));
        assert!(html.contains("&lt;b&gt;") && !html.contains("<b>"), "settings escaped");
        assert!(!html.contains("<script"), "no script");
        assert_eq!(html.matches("http").count(), html.matches("http://www.w3.org/2000/svg").count(), "nothing from elsewhere");
        // A damaged line in the middle is named.
        std::fs::write(&log, "{\"step\":1}\nnot json\n{\"step\":2}\n").unwrap();
        let e = read_log(&log).unwrap_err().to_string();
        assert!(e.contains("line 2: not JSON"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
