//! latency.png: one row per system (sandpit's measurements, then the baselines) with every
//! sample as a dot, the 25-75 % box, the 5-95 % whiskers and the median, on a log scale.
//!
//! Text needs a font, and a static binary can use neither fontconfig nor freetype: DejaVu
//! Sans (Debian's fonts-dejavu-core, installed by scripts/setup.sh) is read at run time and
//! handed to plotters' ab_glyph renderer. Without it the chart is drawn without any text.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::anyhow;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::report::{Header, Report, quantile};

/// Where distributions keep DejaVu Sans.
const FONT_PATHS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

const SANDPIT: RGBColor = RGBColor(31, 119, 180);
const BASELINE: RGBColor = RGBColor(150, 150, 150);

/// One row of the chart.
pub(super) struct Series {
    pub label: String,
    pub samples: Vec<f64>,
    pub baseline: bool,
}

/// The rows a report has samples for, top to bottom.
pub(super) fn series(report: &Report, h: &Header) -> Vec<Series> {
    let rows = [
        ("pool claim -> first exec", "pool_first_exec", false),
        ("cold create -> first exec", "cold_first_exec", false),
        (
            &*format!("{} concurrent creates -> exec", h.concurrency),
            "concurrent_first_exec",
            false,
        ),
        ("sustained: create", "sustained_create", false),
        ("sustained: delete", "sustained_delete", false),
        ("exec round trip", "exec_rtt", false),
        ("daemon GET /v1/sandboxes/{id}", "daemon_get", false),
        ("crun run", "baseline.crun_run", true),
        (
            &*format!("crun run, {} at once", h.concurrency),
            "baseline.crun_run_concurrent",
            true,
        ),
        ("runsc --platform=ptrace run", "baseline.runsc_ptrace", true),
        ("bwrap --unshare-all", "baseline.bwrap", true),
        ("unshare (sandpit's namespaces)", "baseline.unshare", true),
        ("fork+exec", "baseline.fork_exec", true),
    ];
    let idle: Vec<(String, String)> = h
        .idle
        .iter()
        .map(|n| {
            (
                format!("exec in each of {n} idle"),
                format!("idle.{n}.exec"),
            )
        })
        .collect();
    let idle_rows = idle.iter().map(|(l, k)| (l.as_str(), k.as_str(), false));
    // The idle rows go after sandpit's own rows, before the baselines.
    let (own, base): (Vec<_>, Vec<_>) = rows.into_iter().partition(|r| !r.2);
    own.into_iter()
        .chain(idle_rows)
        .chain(base)
        .filter_map(|(label, key, baseline)| {
            let samples = report.samples.get(key)?.clone();
            (!samples.is_empty()).then(|| Series {
                label: label.to_string(),
                samples,
                baseline,
            })
        })
        .collect()
}

/// Draws the chart of `report` to `path`; Ok(Some(why)) when it had to leave something out.
pub(super) fn draw(path: &Path, report: &Report, h: &Header) -> anyhow::Result<Option<String>> {
    let rows = series(report, h);
    if rows.is_empty() {
        return Err(anyhow!("no latency was measured"));
    }
    let labels = font_loaded();
    draw_series(
        path,
        &rows,
        &format!("sandpit bench {}: latency per system", h.started),
        labels,
    )?;
    Ok((!labels).then(|| "without text: no DejaVu Sans font found".to_string()))
}

/// Registers DejaVu Sans as plotters' sans-serif font, once; whether text can be drawn.
fn font_loaded() -> bool {
    static LOADED: OnceLock<bool> = OnceLock::new();
    *LOADED.get_or_init(|| {
        FONT_PATHS.iter().any(|p| {
            let Ok(bytes) = std::fs::read(p) else {
                return false;
            };
            // plotters keeps fonts for the life of the process; so does this one, once.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
        })
    })
}

pub(super) fn draw_series(
    path: &Path,
    rows: &[Series],
    title: &str,
    labels: bool,
) -> anyhow::Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("draw {}: {e}", path.display());
    let (lo, hi) = rows
        .iter()
        .flat_map(|s| s.samples.iter().copied())
        .filter(|v| *v > 0.0)
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return Err(anyhow!("no positive samples"));
    }
    let (lo, hi) = (lo / 1.5, hi * 1.5);
    let n = rows.len();
    let height = 110 + 42 * n as u32;
    let root = BitMapBackend::new(path, (1300, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .margin(16)
        .margin_left(380)
        .x_label_area_size(if labels { 40 } else { 8 });
    if labels {
        builder.caption(title, ("sans-serif", 22));
    }
    let mut chart = builder
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..n as f64)
        .map_err(|e| err(&e))?;
    if labels {
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .light_line_style(WHITE.mix(0.0))
            .x_desc("milliseconds (log scale)")
            .x_label_formatter(&|v| {
                if *v >= 1.0 {
                    format!("{v:.0}")
                } else {
                    format!("{v}")
                }
            })
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(|e| err(&e))?;
    } else {
        // plotters' mesh measures its (even absent) labels with the font; without one, a line
        // at each power of ten stands in for the axis.
        let mut decade = 10f64.powf(lo.log10().ceil());
        while decade <= hi {
            chart
                .draw_series([PathElement::new(
                    vec![(decade, 0.0), (decade, n as f64)],
                    BLACK.mix(0.2).stroke_width(1),
                )])
                .map_err(|e| err(&e))?;
            decade *= 10.0;
        }
    }
    if labels {
        let style = TextStyle::from(("sans-serif", 14).into_font()).color(&BLACK);
        root.draw_text(
            "blue: sandpit, grey: baselines; dots: samples, box: 25-75 %, whiskers: 5-95 %, bar: median",
            &style,
            (16, height as i32 - 22),
        )
        .map_err(|e| err(&e))?;
    }

    for (i, s) in rows.iter().enumerate() {
        // Row 0 at the top.
        let y = (n - 1 - i) as f64 + 0.5;
        let color = if s.baseline { BASELINE } else { SANDPIT };
        let mut sorted: Vec<f64> = s.samples.iter().copied().filter(|v| *v > 0.0).collect();
        sorted.sort_by(f64::total_cmp);
        let q = |p: f64| quantile(&sorted, p).unwrap_or(lo);
        chart
            .draw_series(sorted.iter().enumerate().map(|(j, v)| {
                // Spread the dots over the row's height (golden-ratio sequence: even and
                // deterministic) so that equal values do not hide each other.
                let jitter = (j as f64 * 0.618_034).fract() * 0.5 - 0.25;
                Circle::new((*v, y + jitter), 2, color.mix(0.35).filled())
            }))
            .map_err(|e| err(&e))?;
        chart
            .draw_series([
                PathElement::new(vec![(q(0.05), y), (q(0.95), y)], color.stroke_width(2)),
                PathElement::new(
                    vec![(q(0.05), y - 0.12), (q(0.05), y + 0.12)],
                    color.stroke_width(2),
                ),
                PathElement::new(
                    vec![(q(0.95), y - 0.12), (q(0.95), y + 0.12)],
                    color.stroke_width(2),
                ),
            ])
            .map_err(|e| err(&e))?;
        chart
            .draw_series([Rectangle::new(
                [(q(0.25), y - 0.3), (q(0.75), y + 0.3)],
                color.mix(0.25).filled(),
            )])
            .map_err(|e| err(&e))?;
        chart
            .draw_series([
                Rectangle::new(
                    [(q(0.25), y - 0.3), (q(0.75), y + 0.3)],
                    color.stroke_width(1),
                ),
                Rectangle::new(
                    [(q(0.5), y - 0.34), (q(0.5), y + 0.34)],
                    BLACK.stroke_width(3),
                ),
            ])
            .map_err(|e| err(&e))?;
        if labels {
            let (px, py) = chart.backend_coord(&(lo, y));
            let style = TextStyle::from(("sans-serif", 16).into_font())
                .color(&BLACK)
                .pos(Pos::new(HPos::Right, VPos::Center));
            let text = format!("{}  p50 {}", s.label, fmt_ms(q(0.5)));
            root.draw_text(&text, &style, (px - 10, py))
                .map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

fn fmt_ms(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.2} ms")
    } else {
        format!("{v:.1} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_without_a_font() {
        let dir = std::env::temp_dir().join(format!("sandpit-chart-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("latency.png");
        let rows = vec![
            Series {
                label: "a".into(),
                samples: vec![1.0, 2.0, 3.0, 40.0],
                baseline: false,
            },
            Series {
                label: "b".into(),
                samples: vec![0.5],
                baseline: true,
            },
        ];
        draw_series(&path, &rows, "t", false).unwrap();
        let png = std::fs::read(&path).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
