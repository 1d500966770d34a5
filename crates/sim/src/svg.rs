//! A dependency-free SVG of the runs, like the paper's Figs. 6 and 9: throughput (top) and
//! cumulative trained samples (bottom) over time, one line per policy, failures marked.

use std::fmt::Write;

use crate::engine::PolicyReport;

const COLORS: [&str; 6] = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Render the reports (all over the same duration) with a title.
pub fn render(reports: &[PolicyReport], duration_s: f64, title: &str) -> String {
    let (w, h, left, right, top, gap, panel) = (900.0, 640.0, 70.0, 20.0, 40.0, 60.0, 240.0);
    let plot_w = w - left - right;
    let x = |t: f64| left + plot_w * (t / duration_s.max(1e-9));
    let mut out = String::new();
    let _ = writeln!(out, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#);
    let _ = writeln!(out, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(out, r#"<text x="{left}" y="22" font-size="15">{}</text>"#, escape(title));
    type Metric = fn(&crate::engine::SeriesPoint) -> f64;
    let panels: [(&str, Metric); 2] = [("throughput (samples/s)", |p| p.samples_per_s), ("trained samples", |p| p.cumulative_samples)];
    // Failures marked once, in both panels, from the first report (all replay the same trace).
    let failures: Vec<f64> = reports.first().map(|r| r.failures_s.clone()).unwrap_or_default();
    for (k, (label, value)) in panels.iter().enumerate() {
        let y0 = top + k as f64 * (panel + gap);
        let max = reports.iter().flat_map(|r| r.series.iter().map(value)).fold(0.0f64, f64::max).max(1e-9) * 1.05;
        let y = |v: f64| y0 + panel - panel * (v / max);
        let _ = writeln!(out, r##"<rect x="{left}" y="{y0}" width="{plot_w}" height="{panel}" fill="none" stroke="#888"/>"##);
        let _ = writeln!(out, r#"<text x="8" y="{}" >{}</text>"#, y0 + 14.0, escape(label));
        for i in 0..=4 {
            let v = max * i as f64 / 4.0;
            let _ = writeln!(out, r##"<text x="{}" y="{}" text-anchor="end" fill="#444">{:.0}</text>"##, left - 4.0, y(v) + 4.0, v);
        }
        for &f in &failures {
            let _ =
                writeln!(out, r##"<line x1="{0}" x2="{0}" y1="{y0}" y2="{1}" stroke="#bbb" stroke-dasharray="3,3"/>"##, x(f), y0 + panel);
        }
        for (r, color) in reports.iter().zip(COLORS.iter().cycle()) {
            let pts: Vec<String> = std::iter::once((0.0, 0.0))
                .chain(r.series.iter().map(|p| (p.t_s, value(p))))
                .map(|(t, v)| format!("{:.1},{:.1}", x(t), y(v)))
                .collect();
            let _ = writeln!(out, r#"<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{}"/>"#, pts.join(" "));
        }
    }
    let axis_y = top + 2.0 * panel + gap + 18.0;
    for i in 0..=6 {
        let t = duration_s * i as f64 / 6.0;
        let _ = writeln!(out, r#"<text x="{}" y="{axis_y}" text-anchor="middle">{:.0} min</text>"#, x(t), t / 60.0);
    }
    for (i, (r, color)) in reports.iter().zip(COLORS.iter().cycle()).enumerate() {
        // Three to a row.
        let lx = left + 10.0 + 260.0 * (i % 3) as f64;
        let ly = h - 30.0 + 16.0 * (i / 3) as f64;
        let _ = writeln!(out, r#"<rect x="{lx}" y="{}" width="14" height="4" fill="{color}"/>"#, ly - 5.0);
        let _ = writeln!(out, r#"<text x="{}" y="{ly}">{} ({:.0} samples)</text>"#, lx + 20.0, r.policy.name(), r.trained_samples);
    }
    let _ = writeln!(
        out,
        r##"<text x="{}" y="{}" fill="#888" text-anchor="end">dashed: failures of nodes in use</text>"##,
        w - right,
        h - 14.0
    );
    out.push_str("</svg>\n");
    out
}

/// A sweep's chart: ETTR (0 to 1) of each policy at each value of the swept setting, the values
/// evenly spaced in the order given. `series` holds a policy's name and its ETTR per value.
pub fn render_sweep(setting: &str, values: &[String], series: &[(&str, Vec<f64>)], title: &str) -> String {
    let (w, h, left, right, top, plot_h) = (900.0, 420.0, 70.0, 20.0, 40.0, 300.0);
    let plot_w = w - left - right;
    let x = |i: usize| left + plot_w * (i as f64 + 0.5) / values.len().max(1) as f64;
    // ETTR from the lowest shown (rounded down to a tenth) to 1.
    let low = series.iter().flat_map(|(_, v)| v.iter().copied()).fold(1.0f64, f64::min).clamp(0.0, 1.0);
    let floor = (low * 10.0).floor() / 10.0;
    let floor = if floor >= 1.0 { 0.9 } else { floor };
    let y = |v: f64| top + plot_h - plot_h * ((v - floor) / (1.0 - floor)).clamp(0.0, 1.0);
    let mut out = String::new();
    let _ = writeln!(out, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#);
    let _ = writeln!(out, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(out, r#"<text x="{left}" y="22" font-size="15">{}</text>"#, escape(title));
    let _ = writeln!(out, r##"<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>"##);
    let _ = writeln!(out, r#"<text x="8" y="{}">ETTR</text>"#, top - 8.0);
    for i in 0..=4 {
        let v = floor + (1.0 - floor) * i as f64 / 4.0;
        let _ = writeln!(out, r##"<text x="{}" y="{}" text-anchor="end" fill="#444">{v:.2}</text>"##, left - 4.0, y(v) + 4.0);
    }
    for (i, v) in values.iter().enumerate() {
        let _ = writeln!(out, r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#, x(i), top + plot_h + 18.0, escape(v));
    }
    let _ =
        writeln!(out, r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#, left + plot_w / 2.0, top + plot_h + 36.0, escape(setting));
    for (k, ((name, ettr), color)) in series.iter().zip(COLORS.iter().cycle()).enumerate() {
        let pts: Vec<String> = ettr.iter().enumerate().map(|(i, &v)| format!("{:.1},{:.1}", x(i), y(v))).collect();
        let _ = writeln!(out, r#"<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{}"/>"#, pts.join(" "));
        let lx = left + 10.0 + 140.0 * k as f64;
        let _ = writeln!(out, r#"<rect x="{lx}" y="{}" width="14" height="4" fill="{color}"/>"#, h - 19.0);
        let _ = writeln!(out, r#"<text x="{}" y="{}">{}</text>"#, lx + 20.0, h - 14.0, escape(name));
    }
    out.push_str("</svg>\n");
    out
}
