//! The report's pictures, as inline SVG (no script, no fonts or files from elsewhere): line
//! charts over steps and a heatmap of each expert's share of its layer's tokens.

use std::fmt::Write as _;

/// The most points a line is drawn with (a long run's steps are thinned evenly).
const MOST_POINTS: usize = 2000;

pub(super) fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// One line of a chart: its name, colour and (step, value) points.
pub(super) struct Line<'a> {
    pub name: &'a str,
    pub color: &'a str,
    pub points: Vec<(f64, f64)>,
}

/// `points` with at most [`MOST_POINTS`] of them, evenly spaced, the last always kept.
fn thinned(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    if points.len() <= MOST_POINTS {
        return points.to_vec();
    }
    let every = points.len().div_ceil(MOST_POINTS);
    let mut out: Vec<(f64, f64)> = points.iter().step_by(every).copied().collect();
    if out.last() != points.last() {
        out.extend(points.last());
    }
    out
}

/// A line chart of `lines` over steps, with vertical marks at `marks` (the steps of moves).
pub(super) fn line_chart(title: &str, lines: &[Line<'_>], marks: &[f64]) -> String {
    let (w, h, left, right, top, bottom) = (860.0, 260.0, 64.0, 16.0, 28.0, 36.0);
    let finite = || lines.iter().flat_map(|l| l.points.iter()).filter(|p| p.0.is_finite() && p.1.is_finite());
    let (x0, x1) = finite().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = finite().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let mut out = String::new();
    let _ =
        write!(out, r#"<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img">"#);
    let _ = write!(out, r#"<title>{}</title><text x="{left}" y="18" class="title">{}</text>"#, escape(title), escape(title));
    if !x0.is_finite() || !y0.is_finite() {
        let _ = write!(out, r#"<text x="{left}" y="{}">nothing recorded</text></svg>"#, h / 2.0);
        return out;
    }
    let (x1, y1) = (if x1 > x0 { x1 } else { x0 + 1.0 }, if y1 > y0 { y1 } else { y0 + 1.0 });
    let (pw, ph) = (w - left - right, h - top - bottom);
    let x = |v: f64| left + pw * (v - x0) / (x1 - x0);
    let y = |v: f64| top + ph - ph * (v - y0) / (y1 - y0);
    let _ = write!(out, r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>"##);
    for i in 0..=4 {
        let v = y0 + (y1 - y0) * f64::from(i) / 4.0;
        let _ = write!(out, r#"<text x="{}" y="{:.1}" class="tick" text-anchor="end">{}</text>"#, left - 4.0, y(v) + 4.0, short(v));
        let s = x0 + (x1 - x0) * f64::from(i) / 4.0;
        let _ = write!(out, r#"<text x="{:.1}" y="{}" class="tick" text-anchor="middle">{}</text>"#, x(s), h - bottom + 16.0, short(s));
    }
    for &m in marks.iter().filter(|m| (x0..=x1).contains(*m)) {
        let _ =
            write!(out, r##"<line x1="{0:.1}" x2="{0:.1}" y1="{top}" y2="{1}" stroke="#c33" stroke-dasharray="4,3"/>"##, x(m), top + ph);
    }
    for (k, line) in lines.iter().enumerate() {
        let pts: Vec<String> = thinned(&line.points)
            .into_iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .map(|(a, b)| format!("{:.1},{:.1}", x(a), y(b)))
            .collect();
        match pts.len() {
            0 => {}
            1 => {
                let (cx, cy) = pts[0].split_once(',').unwrap_or(("0", "0"));
                let _ = write!(out, r#"<circle cx="{cx}" cy="{cy}" r="3" fill="{}"/>"#, line.color);
            }
            _ => {
                let _ = write!(out, r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#, line.color, pts.join(" "));
            }
        }
        let lx = left + 8.0 + 170.0 * k as f64;
        let _ = write!(out, r#"<rect x="{lx}" y="{}" width="12" height="3" fill="{}"/>"#, top + 8.0, line.color);
        let _ = write!(out, r#"<text x="{}" y="{}" class="tick">{}</text>"#, lx + 16.0, top + 13.0, escape(line.name));
    }
    out.push_str("</svg>");
    out
}

/// A number as a tick label: few digits, an exponent for the very large or small.
fn short(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-2..1e6).contains(&a) {
        format!("{v:.1e}")
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}").trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Each expert's share of its layer's tokens over steps: a row per expert, a column per span of
/// steps; white at an even share (1/E), red above it, blue below.
pub(super) fn load_heatmap(title: &str, steps: &[u64], shares: &[Vec<f64>]) -> String {
    let experts = shares.first().map_or(0, Vec::len);
    let columns = steps.len().clamp(1, 120);
    let cell_w = (720.0 / columns as f64).clamp(4.0, 48.0);
    let (cell_h, left, top) = (12.0f64.min(360.0 / experts.max(1) as f64).max(3.0), 64.0, 28.0);
    let (w, h) = ((left + cell_w * columns as f64 + 16.0).max(620.0), top + cell_h * experts as f64 + 34.0);
    let mut out = String::new();
    let _ =
        write!(out, r#"<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img">"#);
    let _ = write!(out, r#"<title>{}</title><text x="{left}" y="18" class="title">{}</text>"#, escape(title), escape(title));
    if steps.is_empty() || experts == 0 {
        out.push_str("</svg>");
        return out;
    }
    let even = 1.0 / experts as f64;
    let per = steps.len().div_ceil(columns);
    for (c, chunk) in shares.chunks(per).enumerate() {
        for e in 0..experts {
            let mean = chunk.iter().map(|s| s.get(e).copied().unwrap_or(0.0)).sum::<f64>() / chunk.len() as f64;
            // -1 (none of the tokens) … 0 (an even share) … +1 (twice an even share or more).
            let d = ((mean - even) / even).clamp(-1.0, 1.0);
            let (r, g, b) =
                if d >= 0.0 { (255.0, 255.0 * (1.0 - d), 255.0 * (1.0 - d)) } else { (255.0 * (1.0 + d), 255.0 * (1.0 + d), 255.0) };
            let _ = write!(
                out,
                r#"<rect x="{:.1}" y="{:.1}" width="{cell_w:.1}" height="{cell_h:.1}" fill="rgb({:.0},{:.0},{:.0})"><title>expert {e}: {:.1}%</title></rect>"#,
                left + cell_w * c as f64,
                top + cell_h * e as f64,
                r,
                g,
                b,
                100.0 * mean
            );
        }
    }
    for e in (0..experts).step_by((experts / 8).max(1)) {
        let _ = write!(
            out,
            r#"<text x="{}" y="{:.1}" class="tick" text-anchor="end">e{e}</text>"#,
            left - 4.0,
            top + cell_h * (e as f64 + 0.8)
        );
    }
    let _ = write!(
        out,
        r#"<text x="{left}" y="{:.1}" class="tick">steps {}–{} · white: an even share (1/{experts}), red: more, blue: less</text></svg>"#,
        h - 10.0,
        steps[0],
        steps[steps.len() - 1]
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_whole_svg_with_names_escaped_and_long_lines_thinned() {
        let points: Vec<(f64, f64)> = (0..10_000).map(|i| (f64::from(i), f64::from(i).sqrt())).collect();
        let svg = line_chart("loss <train>", &[Line { name: "a&b", color: "#000", points }], &[500.0, 1e9]);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert!(svg.contains("loss &lt;train&gt;") && svg.contains("a&amp;b") && !svg.contains("<train>"));
        let drawn = svg.split("points=\"").nth(1).unwrap().split('"').next().unwrap().split(' ').count();
        assert!(drawn <= MOST_POINTS + 1, "{drawn} points");
        assert_eq!(svg.matches("stroke-dasharray").count(), 1, "a mark outside the steps is not drawn");
        let empty = line_chart("nothing", &[Line { name: "x", color: "#000", points: vec![(1.0, f64::NAN)] }], &[]);
        assert!(empty.contains("nothing recorded") && empty.ends_with("</svg>"));
        let heat = load_heatmap("layer 0", &[1, 2, 3], &[vec![0.5, 0.5], vec![1.0, 0.0], vec![0.0, 1.0]]);
        assert_eq!(heat.matches("<rect").count(), 6, "3 columns x 2 experts");
        assert!(heat.contains("rgb(255,255,255)") && heat.contains("rgb(255,0,0)") && heat.contains("rgb(0,0,255)"));
    }
}
