//! `lbscale chart --samples FILE.csv --out FILE.svg [--events FILE.json]
//! [--max-mbps X] [--min-mbps Y] [--title TEXT]`: draws a scaling run as an SVG.
//!
//! The samples file is CSV with a header line naming at least `t_ms` (Unix ms) and
//! any of `serving`, `provisioned` (node counts), `load_mbps` (what the load
//! generator received) and `sample_mbps` (the daemon's per-node throughput
//! sample). The chart has two panels on one time axis (seconds from the first
//! sample): throughput in Mbps above, with the thresholds as dashed lines, and the
//! node counts below. `--events` takes the JSON of the daemon's
//! `/v1/events?group=NAME` (`{"events": [{"time_ms", "kind", ...}]}`) and marks
//! each event with a labelled vertical line.

use std::fmt::Write as _;

use crate::cmd::daemon::flag_pairs;
use crate::output::CliError;

const FLAGS: &str = "--samples, --out, --events, --max-mbps, --min-mbps, --title";

const W: f64 = 1000.0;
const H: f64 = 660.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 30.0;
const TOP1: f64 = 130.0;
/// Event kinds marked on the chart (the others are in the timeline).
const MARKED: &[&str] = &[
    "scale_out",
    "node_active",
    "cooldown_end",
    "scale_in",
    "drain_end",
    "node_removed",
];
const BOT1: f64 = 380.0;
const TOP2: f64 = 430.0;
const BOT2: f64 = 560.0;

struct Samples {
    t: Vec<f64>,
    cols: Vec<(String, Vec<Option<f64>>)>,
}

impl Samples {
    fn col(&self, name: &str) -> Option<&[Option<f64>]> {
        self.cols
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
}

fn read_samples(path: &str) -> Result<(Samples, f64), CliError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Unreadable(format!("--samples: cannot read {path}: {e}")))?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<String> = lines
        .next()
        .ok_or_else(|| CliError::Unreadable(format!("--samples: {path} is empty")))?
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    let ti = header.iter().position(|h| h == "t_ms").ok_or_else(|| {
        CliError::Unreadable(format!(
            "--samples: {path}: the header must name a t_ms column, got {header:?}"
        ))
    })?;
    let mut t = Vec::new();
    let mut cols: Vec<(String, Vec<Option<f64>>)> = header
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != ti)
        .map(|(_, h)| (h.clone(), Vec::new()))
        .collect();
    for (n, line) in lines.enumerate() {
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        let Some(ms) = cells.get(ti).and_then(|c| c.parse::<f64>().ok()) else {
            return Err(CliError::Unreadable(format!(
                "--samples: {path} line {}: t_ms must be a number, got {line:?}",
                n + 2
            )));
        };
        t.push(ms);
        let mut k = 0;
        for (i, _) in header.iter().enumerate() {
            if i == ti {
                continue;
            }
            cols[k].1.push(
                cells
                    .get(i)
                    .and_then(|c| c.parse::<f64>().ok())
                    .filter(|v| v.is_finite()),
            );
            k += 1;
        }
    }
    if t.is_empty() {
        return Err(CliError::Unreadable(format!(
            "--samples: {path} has no sample after its header"
        )));
    }
    let t0 = t[0];
    let t = t.iter().map(|ms| (ms - t0) / 1000.0).collect();
    Ok((Samples { t, cols }, t0))
}

fn read_events(path: &str, t0_ms: f64) -> Result<Vec<(f64, String)>, CliError> {
    let v = crate::output::read_json(path)?;
    let list = v.get("events").and_then(|e| e.as_array()).ok_or_else(|| {
        CliError::Unreadable(format!(
            "--events: {path} must be the JSON of /v1/events ({{\"events\": [...]}})"
        ))
    })?;
    Ok(list
        .iter()
        .filter_map(|e| {
            let ms = e.get("time_ms")?.as_f64()?;
            let kind = e.get("kind")?.as_str()?.to_string();
            Some(((ms - t0_ms) / 1000.0, kind))
        })
        .collect())
}

/// A "nice" step for about `n` ticks over `span`.
fn tick_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    mag * if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

pub fn run(args: &[String]) -> Result<(), CliError> {
    let (mut samples, mut out, mut events) = (None, None, None);
    let (mut max_mbps, mut min_mbps) = (None, None);
    let mut title = "lbscale: nodes and load over time".to_string();
    for (flag, value) in flag_pairs(args, FLAGS)? {
        match flag.as_str() {
            "--samples" => samples = Some(value),
            "--out" => out = Some(value),
            "--events" => events = Some(value),
            "--max-mbps" | "--min-mbps" => {
                let v = value
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0);
                let v = v.ok_or_else(|| {
                    CliError::Usage(format!("{flag}: must be a number from 0, got {value:?}"))
                })?;
                if flag == "--max-mbps" {
                    max_mbps = Some(v)
                } else {
                    min_mbps = Some(v)
                }
            }
            "--title" => title = value,
            other => {
                return Err(CliError::Usage(format!(
                    "{other}: must be one of {FLAGS}, got an unknown argument"
                )))
            }
        }
    }
    let samples = samples.ok_or_else(|| {
        CliError::Usage("--samples: must be given (a CSV file), got nothing".into())
    })?;
    let out = out.ok_or_else(|| {
        CliError::Usage("--out: must be given (an .svg file), got nothing".into())
    })?;
    let (s, t0) = read_samples(&samples)?;
    let evs = match &events {
        Some(p) => read_events(p, t0)?,
        None => Vec::new(),
    };
    let svg = render(&s, &evs, max_mbps, min_mbps, &title);
    std::fs::write(&out, svg)
        .map_err(|e| CliError::Output(format!("--out: cannot write {out}: {e}")))?;
    println!("{out}");
    Ok(())
}

fn render(
    s: &Samples,
    events: &[(f64, String)],
    max_mbps: Option<f64>,
    min_mbps: Option<f64>,
    title: &str,
) -> String {
    let t_end = s.t.last().copied().unwrap_or(0.0).max(1.0);
    let x = |t: f64| LEFT + (t.clamp(0.0, t_end) / t_end) * (W - LEFT - RIGHT);
    let series_max = |name: &str| {
        s.col(name)
            .map(|v| v.iter().flatten().fold(0.0f64, |a, b| a.max(*b)))
            .unwrap_or(0.0)
    };
    let mbps_top = series_max("load_mbps")
        .max(series_max("sample_mbps"))
        .max(max_mbps.unwrap_or(0.0) * 1.25)
        .max(1.0)
        * 1.1;
    let y1 = |v: f64| BOT1 - (v / mbps_top).clamp(0.0, 1.0) * (BOT1 - TOP1);
    let nodes_top = (series_max("serving").max(series_max("provisioned")) + 1.0).max(2.0);
    let y2 = |v: f64| BOT2 - (v / nodes_top).clamp(0.0, 1.0) * (BOT2 - TOP2);

    let mut o = String::new();
    let _ = write!(
        o,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">
<rect width="100%" height="100%" fill="#ffffff"/>
<text x="{LEFT}" y="28" font-size="17" font-weight="bold" fill="#222">{}</text>
"##,
        esc(title)
    );

    // Grid and axes of both panels.
    let ystep = tick_step(mbps_top, 5.0);
    let mut v = 0.0;
    while v <= mbps_top + 1e-9 {
        let y = y1(v);
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#e6e6e6"/><text x="{}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            fmt_num(v)
        );
        v += ystep;
    }
    for n in 0..=(nodes_top as i64) {
        let y = y2(n as f64);
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#e6e6e6"/><text x="{}" y="{:.1}" text-anchor="end" fill="#555">{n}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0
        );
    }
    let xstep = tick_step(t_end, 10.0);
    let mut t = 0.0;
    while t <= t_end + 1e-9 {
        let xx = x(t);
        let _ = writeln!(
            o,
            r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="{TOP1}" y2="{BOT1}" stroke="#f0f0f0"/><line x1="{xx:.1}" x2="{xx:.1}" y1="{TOP2}" y2="{BOT2}" stroke="#f0f0f0"/><text x="{xx:.1}" y="{}" text-anchor="middle" fill="#555">{}</text>"##,
            BOT2 + 18.0,
            fmt_num(t)
        );
        t += xstep;
    }
    for (top, bot) in [(TOP1, BOT1), (TOP2, BOT2)] {
        let _ = writeln!(
            o,
            r##"<rect x="{LEFT}" y="{top}" width="{}" height="{}" fill="none" stroke="#888"/>"##,
            W - LEFT - RIGHT,
            bot - top
        );
    }
    let _ = writeln!(
        o,
        r##"<text x="{}" y="{}" text-anchor="middle" fill="#333">seconds since the first sample</text>"##,
        (LEFT + W - RIGHT) / 2.0,
        BOT2 + 40.0
    );
    let _ = writeln!(
        o,
        r##"<text transform="translate(20 {}) rotate(-90)" text-anchor="middle" fill="#333">throughput (Mbps)</text>"##,
        (TOP1 + BOT1) / 2.0
    );
    let _ = writeln!(
        o,
        r##"<text transform="translate(20 {}) rotate(-90)" text-anchor="middle" fill="#333">nodes</text>"##,
        (TOP2 + BOT2) / 2.0
    );

    // Thresholds.
    for (v, label, color) in [
        (max_mbps, "scale out above", "#d62728"),
        (min_mbps, "scale in below", "#2ca02c"),
    ] {
        if let Some(v) = v {
            let y = y1(v);
            let _ = writeln!(
                o,
                r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="{color}" stroke-dasharray="6 4" stroke-width="1.2"/><text x="{}" y="{:.1}" text-anchor="end" fill="{color}" font-size="11">{label} {} Mbps per node</text>"##,
                W - RIGHT,
                W - RIGHT - 4.0,
                y - 4.0,
                fmt_num(v)
            );
        }
    }

    // Event markers: the steps that matter, one line per cluster of events less
    // than 30 px apart, their kinds stacked above the panel.
    let mut clusters: Vec<(f64, Vec<&str>)> = Vec::new();
    for (t, kind) in events {
        if *t < -0.5 || *t > t_end + 0.5 || !MARKED.contains(&kind.as_str()) {
            continue;
        }
        let xx = x(*t);
        match clusters.last_mut() {
            Some((cx, kinds)) if xx - *cx < 30.0 => {
                if !kinds.contains(&kind.as_str()) {
                    kinds.push(kind)
                }
            }
            _ => clusters.push((xx, vec![kind])),
        }
    }
    for (xx, kinds) in &clusters {
        let color = if kinds.contains(&"scale_out") {
            "#d62728"
        } else if kinds.contains(&"scale_in") {
            "#2ca02c"
        } else {
            "#777"
        };
        let top = TOP1 - 6.0 - 13.0 * kinds.len() as f64;
        let _ = writeln!(
            o,
            r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="{top:.1}" y2="{BOT2}" stroke="{color}" stroke-dasharray="2 3" stroke-width="1"/>"##
        );
        for (i, k) in kinds.iter().enumerate() {
            let _ = writeln!(
                o,
                r##"<text x="{:.1}" y="{:.1}" fill="{color}" font-size="11">{}</text>"##,
                xx + 3.0,
                top + 10.0 + 13.0 * i as f64,
                esc(k)
            );
        }
    }

    // Series.
    let line = |o: &mut String,
                col: &str,
                y: &dyn Fn(f64) -> f64,
                color: &str,
                width: f64,
                dash: &str,
                step: bool| {
        let Some(vals) = s.col(col) else { return };
        let mut d = String::new();
        let mut prev: Option<(f64, f64)> = None;
        for (t, v) in s.t.iter().zip(vals) {
            match v {
                Some(v) => {
                    let (px, py) = (x(*t), y(*v));
                    match prev {
                        None => {
                            let _ = write!(d, "M{px:.1},{py:.1}");
                        }
                        Some((_, qy)) if step => {
                            let _ = write!(d, " L{px:.1},{qy:.1} L{px:.1},{py:.1}");
                        }
                        Some(_) => {
                            let _ = write!(d, " L{px:.1},{py:.1}");
                        }
                    }
                    prev = Some((px, py));
                }
                None => prev = None,
            }
        }
        if !d.is_empty() {
            let _ = writeln!(
                o,
                r##"<path d="{d}" fill="none" stroke="{color}" stroke-width="{width}" stroke-linejoin="round" {dash}/>"##
            );
        }
    };
    line(&mut o, "load_mbps", &y1, "#1f77b4", 2.0, "", false);
    line(&mut o, "sample_mbps", &y1, "#ff7f0e", 1.6, "", false);
    line(&mut o, "serving", &y2, "#2ca02c", 2.5, "", true);
    line(
        &mut o,
        "provisioned",
        &y2,
        "#9467bd",
        1.5,
        r#"stroke-dasharray="5 3""#,
        true,
    );

    // Legend.
    let items: Vec<(&str, &str, &str)> = [
        (
            "load_mbps",
            "#1f77b4",
            "load generator: Mbps received (all nodes)",
        ),
        (
            "sample_mbps",
            "#ff7f0e",
            "daemon's sample: Mbps per serving node (mean)",
        ),
        ("serving", "#2ca02c", "nodes serving (in DNS)"),
        (
            "provisioned",
            "#9467bd",
            "nodes in the cloud (dashed; under the green line when equal)",
        ),
    ]
    .into_iter()
    .filter(|(c, _, _)| s.col(c).is_some())
    .collect();
    for (i, (col, color, label)) in items.iter().enumerate() {
        let lx = LEFT + (i % 2) as f64 * 420.0;
        let ly = H - 34.0 + (i / 2) as f64 * 16.0;
        let dash = if *col == "provisioned" {
            r#" stroke-dasharray="5 3""#
        } else {
            ""
        };
        let _ = writeln!(
            o,
            r##"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2.5"{dash}/><text x="{}" y="{}" fill="#333">{label}</text>"##,
            lx + 24.0,
            lx + 30.0,
            ly + 4.0
        );
    }
    o.push_str("</svg>\n");
    o
}

fn fmt_num(v: f64) -> String {
    if (v - v.round()).abs() < 1e-6 {
        format!("{}", v.round() as i64)
    } else {
        format!("{v:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_series_thresholds_and_events() {
        let s = Samples {
            t: vec![0.0, 1.0, 2.0],
            cols: vec![
                ("serving".into(), vec![Some(1.0), Some(2.0), Some(1.0)]),
                ("load_mbps".into(), vec![Some(0.0), Some(12.0), None]),
            ],
        };
        let svg = render(
            &s,
            &[(1.0, "scale_out".into())],
            Some(8.0),
            Some(1.0),
            "t<1>",
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("scale_out") && svg.contains("t&lt;1&gt;"));
        assert!(svg.contains("scale out above 8 Mbps per node"));
        assert_eq!(svg.matches("<path").count(), 2);
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(93.0, 10.0), 10.0);
        assert_eq!(tick_step(26.4, 5.0), 10.0);
        assert_eq!(tick_step(3.0, 5.0), 1.0);
    }
}
