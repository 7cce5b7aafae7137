//! `--plot`: busbw and time against size, as a hand-written SVG.
//!
//! Two panels side by side: bus bandwidth (GB/s, linear) and time per call (log), both
//! against the size (log 2). Every (collective, variant) of a run is one line; the rows of
//! a `--baseline` JSON file (an earlier run, or the MPI peer of benches/peers) are drawn as
//! dashed lines with square markers in the same picture. Series are read from the JSON form
//! of the results (see [`crate::report::to_json`]), so a baseline is read the same way.

use std::fmt::Write as _;

use serde_json::Value;

use crate::args::format_size;

/// One line of the plot.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// The legend text.
    pub label: String,
    /// `(size in bytes, busbw in GB/s, time in us)`, by increasing size.
    pub points: Vec<(f64, f64, f64)>,
    /// Drawn dashed, with square markers.
    pub baseline: bool,
    /// What is measured (collective, dtype, variant, ranks) without who measured it: series
    /// with the same key share a color, so a baseline is drawn in its counterpart's color.
    pub key: String,
}

/// Reads the series of a results JSON (ferroccl-perf's `--json`, or the MPI program's).
/// `None` if it is not such a file.
pub fn series_from_json(v: &Value, baseline: bool) -> Option<Vec<Series>> {
    let label = v.get("label").and_then(Value::as_str).unwrap_or("baseline");
    let ranks = v.get("ranks").and_then(Value::as_u64).map(|n| format!(", {n} ranks")).unwrap_or_default();
    let dtype = v.get("dtype").and_then(Value::as_str).unwrap_or("");
    let mut out = Vec::new();
    for run in v.get("runs")?.as_array()? {
        let coll = run.get("collective")?.as_str()?;
        for (key, name) in [("out_of_place", "out-of-place"), ("in_place", "in-place")] {
            let mut points = Vec::new();
            for row in run.get("rows")?.as_array()? {
                let size = row.get("size")?.as_f64()?;
                let cell = row.get(key).filter(|c| !c.is_null());
                if let Some(c) = cell {
                    points.push((size, c.get("busbw")?.as_f64()?, c.get("time_us")?.as_f64()?));
                }
            }
            if !points.is_empty() {
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                // An f32 stand-in for bf16 ("f32~bf16") measures the bf16 case.
                let case_dtype = dtype.rsplit('~').next().unwrap_or(dtype);
                out.push(Series {
                    label: format!("{label} {coll} {dtype} {name}{ranks}"),
                    points,
                    baseline,
                    key: format!("{coll} {case_dtype} {name}{ranks}"),
                });
            }
        }
    }
    Some(out)
}

const COLORS: [&str; 10] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A "nice" upper bound for a linear axis, and its tick step.
fn nice_axis(max: f64) -> (f64, f64) {
    if max <= 0.0 || !max.is_finite() {
        return (1.0, 0.25);
    }
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

fn time_label(us: f64) -> String {
    if us >= 1e6 {
        format!("{} s", us / 1e6)
    } else if us >= 1e3 {
        format!("{} ms", us / 1e3)
    } else {
        format!("{us} us")
    }
}

/// A plot panel: where it is and how values map into it.
struct Panel {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
    lx0: f64,
    lx1: f64,
    y0: f64,
    y1: f64,
    log_y: bool,
}

impl Panel {
    fn px(&self, size: f64) -> f64 {
        self.x + (size.max(1.0).log2() - self.lx0) / (self.lx1 - self.lx0) * self.w
    }

    fn py(&self, v: f64) -> f64 {
        let (v, a, b) = if self.log_y { (v.max(1e-9).log10(), self.y0.log10(), self.y1.log10()) } else { (v, self.y0, self.y1) };
        self.y + self.h - (v - a) / (b - a) * self.h
    }
}

/// Draws `series` as an SVG document.
pub fn render(title: &str, series: &[Series]) -> String {
    let all: Vec<(f64, f64, f64)> = series.iter().flat_map(|s| s.points.iter().copied()).collect();
    let (smin, smax) = all.iter().fold((f64::MAX, 0f64), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (smin, smax) = if all.is_empty() { (1.0, 2.0) } else { (smin.max(1.0), smax.max(2.0)) };
    let lx0 = smin.log2().floor();
    let lx1 = smax.log2().ceil().max(lx0 + 1.0);
    let bmax = all.iter().map(|p| p.1).fold(0.0, f64::max);
    let (bw_top, bw_step) = nice_axis(bmax);
    let tmin = all.iter().map(|p| p.2).filter(|t| *t > 0.0).fold(f64::MAX, f64::min);
    let tmax = all.iter().map(|p| p.2).fold(0.0, f64::max);
    let (t0, t1) = if tmax > 0.0 {
        let a = 10f64.powf(tmin.log10().floor());
        let b = 10f64.powf(tmax.log10().ceil());
        (a, if b > a { b } else { a * 10.0 })
    } else {
        (1.0, 10.0)
    };

    let legend_rows = series.len().div_ceil(2);
    let width = 1200.0;
    let height = 520.0 + 20.0 * legend_rows as f64;
    let bw = Panel { x: 80.0, y: 60.0, w: 480.0, h: 370.0, lx0, lx1, y0: 0.0, y1: bw_top, log_y: false };
    let lat = Panel { x: 690.0, y: 60.0, w: 480.0, h: 370.0, lx0, lx1, y0: t0, y1: t1, log_y: true };

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(s, r#"<text x="{}" y="28" text-anchor="middle" font-size="16">{}</text>"#, width / 2.0, esc(title));

    // Axes, grids and labels.
    let xstep = ((lx1 - lx0) / 10.0).ceil().max(1.0) as i64;
    for (p, name) in [(&bw, "bus bandwidth (GB/s)"), (&lat, "time per call")] {
        let _ = writeln!(s, r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#333"/>"##, p.x, p.y, p.w, p.h);
        let mut e = lx0 as i64;
        while e <= lx1 as i64 {
            let x = p.px(2f64.powi(e as i32));
            let _ = writeln!(s, r##"<line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#ddd"/>"##, p.y, p.y + p.h);
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
                p.y + p.h + 16.0,
                format_size(1usize << e.clamp(0, 62))
            );
            e += xstep;
        }
        let _ = writeln!(s, r#"<text x="{}" y="{}" text-anchor="middle">size (bytes)</text>"#, p.x + p.w / 2.0, p.y + p.h + 36.0);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" transform="rotate(-90 {} {})">{name}</text>"#,
            p.x - 55.0,
            p.y + p.h / 2.0,
            p.x - 55.0,
            p.y + p.h / 2.0
        );
    }
    let mut v = 0.0;
    while v <= bw_top + bw_step / 2.0 {
        let y = bw.py(v);
        let _ = writeln!(s, r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/>"##, bw.x, bw.x + bw.w);
        let _ = writeln!(s, r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#, bw.x - 6.0, y + 4.0, (v * 1000.0).round() / 1000.0);
        v += bw_step;
    }
    let mut t = t0;
    while t <= t1 * 1.001 {
        let y = lat.py(t);
        let _ = writeln!(s, r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/>"##, lat.x, lat.x + lat.w);
        let _ = writeln!(s, r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#, lat.x - 6.0, y + 4.0, time_label(t));
        t *= 10.0;
    }

    // Lines, markers, legend.
    let mut keys: Vec<&str> = Vec::new();
    for se in series {
        if !keys.contains(&se.key.as_str()) {
            keys.push(&se.key);
        }
    }
    for (i, se) in series.iter().enumerate() {
        let color = COLORS[keys.iter().position(|k| *k == se.key).unwrap_or(i) % COLORS.len()];
        let dash = if se.baseline { r#" stroke-dasharray="7 4""# } else { "" };
        for (p, pick) in [(&bw, 1usize), (&lat, 2usize)] {
            let pts: Vec<(f64, f64)> =
                se.points.iter().filter(|q| pick == 1 || q.2 > 0.0).map(|q| (p.px(q.0), p.py(if pick == 1 { q.1 } else { q.2 }))).collect();
            let path: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = writeln!(s, r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#, path.join(" "));
            for (x, y) in pts {
                if se.baseline {
                    let _ = writeln!(s, r#"<rect x="{:.1}" y="{:.1}" width="6" height="6" fill="{color}"/>"#, x - 3.0, y - 3.0);
                } else {
                    let _ = writeln!(s, r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{color}"/>"#);
                }
            }
        }
        let lx = 80.0 + (i % 2) as f64 * 560.0;
        let ly = 500.0 + (i / 2) as f64 * 20.0;
        let _ = writeln!(s, r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/>"#, lx + 30.0);
        let _ = writeln!(s, r#"<text x="{}" y="{}">{}</text>"#, lx + 38.0, ly + 4.0, esc(&se.label));
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn series_come_from_json_rows() {
        let v = json!({
            "label": "Open MPI", "ranks": 2, "dtype": "f32",
            "runs": [{ "collective": "allreduce", "rows": [
                { "size": 64, "out_of_place": { "busbw": 0.5, "time_us": 2.0 }, "in_place": null },
                { "size": 8, "out_of_place": { "busbw": 0.1, "time_us": 1.0 }, "in_place": null },
            ]}]
        });
        let s = series_from_json(&v, true).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].label, "Open MPI allreduce f32 out-of-place, 2 ranks");
        assert_eq!(s[0].points, vec![(8.0, 0.1, 1.0), (64.0, 0.5, 2.0)]);
        assert_eq!(s[0].key, "allreduce f32 out-of-place, 2 ranks");
        assert!(series_from_json(&json!({"x": 1}), true).is_none());
    }

    #[test]
    fn svg_has_one_line_per_series_and_panel() {
        let a = Series { label: "a <x>".into(), points: vec![(8.0, 0.0, 3.0), (1024.0, 2.5, 40.0)], baseline: false, key: "k".into() };
        let b = Series { label: "b".into(), points: vec![(8.0, 0.1, 2.0), (1024.0, 2.0, 50.0)], baseline: true, key: "k".into() };
        let svg = render("t & u", &[a, b]);
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert!(svg.contains("a &lt;x&gt;") && svg.contains("t &amp; u"));
        assert!(svg.contains("stroke-dasharray"));
        // Same key, same color: only the first palette entry is used.
        assert!(svg.contains(COLORS[0]) && !svg.contains(COLORS[1]));
        // Empty input still gives a valid document.
        assert!(render("empty", &[]).contains("</svg>"));
    }

    #[test]
    fn axes_are_nice() {
        assert_eq!(nice_axis(9.3), (10.0, 2.0));
        assert_eq!(nice_axis(0.0), (1.0, 0.25));
        assert_eq!(time_label(1000.0), "1 ms");
    }
}
