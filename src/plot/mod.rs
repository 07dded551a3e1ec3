//! Charts for notebooks and reports, drawn with [`plotters`](https://docs.rs/plotters) into SVG:
//! line charts (message-size sweeps on a log₂ axis labelled 4 KiB … 64 MiB, optional log y) and
//! grouped bar charts. One style everywhere: the same palette, fonts and sizes, a grid, tick labels
//! in human units (`KiB`/`MiB`, `MB`, `1.5k`), and the legend in its own column right of the plot so
//! it never covers data. In an evcxr notebook `chart.show()` displays the SVG inline (evcxr's
//! `EVCXR_BEGIN_CONTENT image/svg+xml` protocol); `chart.svg()` returns it.

use plotters::coord::Shift;
use plotters::prelude::*;

mod bar;
mod line;
mod stack;

pub use bar::BarChart;
pub use line::LineChart;
pub use stack::{show_all, stack};

const W: u32 = 720;
const H: u32 = 380;
/// Width of the legend column.
const LEGEND_W: u32 = 170;
const FONT: &str = "sans-serif";
/// The palette (Tableau 10's first eight): series i always gets colour i.
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// How tick values are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Units {
    /// 0.5, 12, 1.5k, 2.3M.
    #[default]
    Plain,
    /// Binary sizes: 512 B, 4 KiB, 64 MiB, 1 GiB.
    Bytes,
    /// Decimal sizes: 1.2 kB, 68 MB, 2.4 GB (what the lessons' memory tables use).
    DecimalBytes,
}

/// Formats `v` in `units` for a tick label.
pub fn human(v: f64, units: Units) -> String {
    let trim = |x: f64| {
        let x = x + 0.0; // no "-0"
                         // Three significant digits for small values (0.00012, 0.0025), whole numbers from 100.
        let decimals =
            if x == 0.0 || x.abs() >= 100.0 { 0 } else { (2 - x.abs().log10().floor() as i32).clamp(0, 12) as usize };
        let s = if x.fract() == 0.0 { format!("{x:.0}") } else { format!("{x:.decimals$}") };
        let s = if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s };
        s
    };
    let scaled = |base: f64, names: [&str; 5]| {
        let mut x = v;
        let mut i = 0;
        while x.abs() >= base && i < names.len() - 1 {
            x /= base;
            i += 1;
        }
        format!("{}{}", trim(x), names[i])
    };
    match units {
        Units::Plain => scaled(1000.0, ["", "k", "M", "G", "T"]),
        Units::Bytes => scaled(1024.0, [" B", " KiB", " MiB", " GiB", " TiB"]),
        Units::DecimalBytes => scaled(1000.0, [" B", " kB", " MB", " GB", " TB"]),
    }
}

/// One axis: linear, log₂ (sizes) or log₁₀, with tick labels in `units`.
fn axis(lo: f64, hi: f64, linear: bool, log2: bool, units: Units) -> Axis {
    Axis { lo, hi, linear, log2, units }
}

/// A plotters coordinate for [`LineChart`]: linear or logarithmic, and its own tick labels.
#[derive(Clone, Copy, Debug)]
struct Axis {
    lo: f64,
    hi: f64,
    linear: bool,
    log2: bool,
    units: Units,
}

impl Axis {
    fn t(&self, v: f64) -> f64 {
        if self.linear {
            v
        } else {
            v.max(f64::MIN_POSITIVE).log10()
        }
    }
}

impl plotters::coord::ranged1d::Ranged for Axis {
    type FormatOption = plotters::coord::ranged1d::NoDefaultFormatting;
    type ValueType = f64;
    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let (a, b) = (self.t(self.lo), self.t(self.hi));
        let f = if b > a { (self.t(*v) - a) / (b - a) } else { 0.5 };
        limit.0 + (f * (limit.1 - limit.0) as f64).round() as i32
    }
    fn key_points<Hint: plotters::coord::ranged1d::KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        let max = hint.max_num_points().max(2);
        if self.linear {
            let span = self.hi - self.lo;
            let raw = span / max as f64;
            let mag = 10f64.powf(raw.log10().floor());
            let step = [1.0, 2.0, 2.5, 5.0, 10.0]
                .iter()
                .map(|m| m * mag)
                .find(|s| span / s <= max as f64)
                .unwrap_or(mag * 10.0);
            let first = (self.lo / step).ceil() * step;
            (0..=max + 1).map(|i| first + i as f64 * step + 0.0).filter(|v| *v <= self.hi + step * 1e-9).collect()
        } else {
            let base: f64 = if self.log2 { 2.0 } else { 10.0 };
            let (a, b) = (self.lo.log(base).floor() as i32, self.hi.log(base).ceil() as i32);
            let inside = |v: &f64| *v >= self.lo * 0.999 && *v <= self.hi * 1.001;
            // Every power, or every 2nd, 4th … (aligned: 4 KiB, 16 KiB, 64 KiB … read well).
            let mut ticks = Vec::new();
            for every in [1, 2, 4, 8, 16, 32] {
                ticks = (a..=b).filter(|e| e.rem_euclid(every) == 0).map(|e| base.powi(e)).filter(inside).collect();
                if ticks.len() <= max {
                    break;
                }
            }
            if ticks.len() < 2 && !self.log2 {
                // Less than a decade: 1, 2, 5 × powers of ten.
                ticks = (a - 1..=b).flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e))).filter(inside).collect();
            }
            if ticks.len() < 2 {
                // Still too few (a range inside one 1-2-5 step): the ends.
                ticks = vec![self.lo, self.hi];
            }
            ticks
        }
    }
    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

impl plotters::coord::ranged1d::ValueFormatter<f64> for Axis {
    fn format_ext(&self, v: &f64) -> String {
        human(*v, self.units)
    }
}

/// A range covering `v` (with a little room), starting at 0 when asked and all values are ≥ 0.
fn range(v: &[f64], log: bool, from_zero: bool) -> (f64, f64) {
    if v.is_empty() {
        return if log { (1.0, 10.0) } else { (0.0, 1.0) };
    }
    let (lo, hi) = v.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    if log {
        let (lo, hi) = if lo == hi { (lo / 2.0, hi * 2.0) } else { (lo, hi) };
        return (lo / 1.15, hi * 1.15);
    }
    // from_zero: the axis includes 0 (bars start there), whatever the signs.
    let (lo, hi) = if from_zero { (lo.min(0.0), hi.max(0.0)) } else { (lo, hi) };
    let pad = if hi > lo { (hi - lo) * 0.06 } else { hi.abs().max(1.0) * 0.1 };
    (if from_zero && lo == 0.0 { 0.0 } else { lo - pad }, if from_zero && hi == 0.0 { 0.0 } else { hi + pad })
}

/// The legend, in its own column: a swatch (a line for line charts, a square for bars) per series.
fn draw_legend<'n>(
    area: &DrawingArea<SVGBackend, Shift>,
    names: impl Iterator<Item = &'n str>,
    boxes: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    for (i, name) in names.enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        let y = 48 + 22 * i as i32;
        if boxes {
            area.draw(&Rectangle::new([(6, y - 6), (18, y + 6)], c.filled()))?;
        } else {
            area.draw(&PathElement::new(vec![(2, y), (22, y)], c.stroke_width(2)))?;
            area.draw(&Circle::new((12, y), 3, c.filled()))?;
        }
        let label: String =
            if name.chars().count() > 24 { name.chars().take(23).chain(['…']).collect() } else { name.into() };
        area.draw(&Text::new(label, (28, y - 7), (FONT, 13).into_font().color(&BLACK)))?;
    }
    Ok(())
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// Draws a chart on a fresh W×H SVG canvas; a drawing error becomes a one-line SVG saying so.
fn render(draw: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> DrawResult) -> String {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (W, H)).into_drawing_area();
        if let Err(e) = draw(&root) {
            return error_svg(&format!("{e}"));
        }
        let _ = root.present();
    }
    out
}

fn error_svg(msg: &str) -> String {
    let esc = msg.replace('&', "&amp;").replace('<', "&lt;");
    format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="40"><text x="8" y="24">chart: {esc}</text></svg>"#
    )
}

/// A pipeline diagram (lesson 13): one row per rank, a box per operation from its start to its
/// end (seconds), forwards light and backwards dark, each labelled with its micro-batch; the
/// white between boxes is the bubble. `rows[r]` holds rank r's `(start, end, micro-batch,
/// is_forward)`.
pub fn timeline_svg(title: &str, rows: &[Vec<(f64, f64, usize, bool)>]) -> String {
    const W: f64 = 760.0;
    const LEFT: f64 = 70.0;
    const ROW: f64 = 28.0;
    let end = rows.iter().flatten().map(|x| x.1).fold(0.0, f64::max).max(1e-12);
    let x = |t: f64| LEFT + (W - LEFT - 10.0) * t / end;
    let h = 40.0 + ROW * rows.len() as f64 + 24.0;
    let esc = title.replace('&', "&amp;").replace('<', "&lt;");
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" font-family="sans-serif" font-size="11"><text x="8" y="18" font-size="13">{esc}</text>"#
    );
    for (r, ops) in rows.iter().enumerate() {
        let y = 30.0 + ROW * r as f64;
        svg.push_str(&format!(r#"<text x="8" y="{}">rank {r}</text>"#, y + 17.0));
        for &(a, b, i, fwd) in ops {
            let (fill, ink) = if fwd { ("#9ecae1", "#08306b") } else { ("#3182bd", "#ffffff") };
            let (xa, xb) = (x(a), x(b).max(x(a) + 1.0));
            svg.push_str(&format!(
                r##"<rect x="{xa:.1}" y="{y}" width="{:.1}" height="{}" fill="{fill}" stroke="#ffffff"/>"##,
                xb - xa,
                ROW - 4.0
            ));
            if xb - xa > 12.0 {
                svg.push_str(&format!(
                    r#"<text x="{:.1}" y="{}" fill="{ink}" text-anchor="middle">{i}</text>"#,
                    (xa + xb) / 2.0,
                    y + 16.0
                ));
            }
        }
    }
    let yb = 30.0 + ROW * rows.len() as f64 + 14.0;
    svg.push_str(&format!(
        r#"<text x="{LEFT}" y="{yb}">0</text><text x="{}" y="{yb}" text-anchor="end">{:.1} ms (light: forward, dark: backward, white: idle)</text></svg>"#,
        W - 10.0,
        end * 1e3
    ));
    svg
}

/// Print an SVG so that evcxr shows it as an image.
///
/// evcxr keeps one image per cell: a second `show` in the same cell replaces the first. To show
/// several charts from one cell, stack them into one image with [`show_all`].
pub fn show_svg(svg: &str) {
    println!("EVCXR_BEGIN_CONTENT image/svg+xml\n{svg}\nEVCXR_END_CONTENT");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_units() {
        assert_eq!(human(4096.0, Units::Bytes), "4 KiB");
        assert_eq!(human(64.0 * 1024.0 * 1024.0, Units::Bytes), "64 MiB");
        assert_eq!(human(1787597.0, Units::DecimalBytes), "1.79 MB");
        assert_eq!(human(67_900_000.0, Units::DecimalBytes), "67.9 MB");
        assert_eq!(human(1500.0, Units::Plain), "1.5k");
        assert_eq!(human(0.25, Units::Plain), "0.25");
        assert_eq!(human(0.00012, Units::Plain), "0.00012");
        assert_eq!(human(-0.0, Units::Plain), "0");
        assert_eq!(human(12.0, Units::Plain), "12");
    }

    /// `SHARDLAB_PLOT_DUMP=dir cargo test --lib plot` writes the test charts there, to look at.
    fn dump(name: &str, svg: &str) {
        if let Ok(dir) = std::env::var("SHARDLAB_PLOT_DUMP") {
            let _ = std::fs::write(std::path::Path::new(&dir).join(format!("{name}.svg")), svg);
        }
    }

    /// `(x, text)` of every `<text>` element.
    fn texts(svg: &str) -> Vec<(f64, String)> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| {
                let x = t.split("x=\"").nth(1)?.split('"').next()?.parse().ok()?;
                let body = t.split_once('>')?.1.split("</text>").next()?.trim().to_string();
                Some((x, body))
            })
            .collect()
    }

    #[test]
    fn a_size_sweep_has_log2_ticks_in_binary_units_and_the_legend_outside_the_plot() {
        let pts: Vec<(f64, f64)> = (12..=26).step_by(2).map(|e| (2f64.powi(e), e as f64 / 10.0)).collect();
        let model: Vec<(f64, f64)> = pts.iter().map(|&(x, y)| (x, y * 1.3)).collect();
        let l =
            LineChart::new("bw", "message size", "GB/s").log2_x().series("ring", pts).series("α-β model", model).svg();
        dump("sweep", &l);
        assert!(l.starts_with("<svg") && l.trim_end().ends_with("</svg>"), "{l}");
        let t = texts(&l);
        let labels: Vec<&str> = t.iter().map(|x| x.1.as_str()).collect();
        for tick in ["4 KiB", "64 KiB", "1 MiB", "16 MiB", "64 MiB"] {
            assert!(labels.contains(&tick), "tick {tick} missing: {labels:?}");
        }
        assert!(!labels.iter().any(|l| l.parse::<f64>().is_ok_and(|v| v >= 1024.0)), "raw byte counts: {labels:?}");
        let (x, _) = t.iter().find(|x| x.1 == "ring").expect("legend entry");
        assert!(*x > (W - LEGEND_W) as f64, "legend at x={x}, inside the plot");
    }

    #[test]
    fn narrow_and_odd_ranges_still_get_ticks() {
        let l = LineChart::new("t", "x", "y").log_y().series("a", vec![(1.0, 15.0), (2.0, 60.0)]).svg();
        let n = texts(&l).iter().filter(|t| t.1.parse::<f64>().is_ok()).count();
        assert!(n >= 4, "x and y ticks on a log y within one decade: {:?}", texts(&l));
        let neg = BarChart::new("n", "y", &["a", "b"]).series("s", vec![-3.0, -1.0]).svg();
        assert!(texts(&neg).iter().any(|t| t.1 == "0"), "a negative bar chart includes 0");
        let one = LineChart::new("t", "x", "y").series("a", vec![(1.0, f64::NAN), (2.0, 3.0)]).svg();
        assert!(one.starts_with("<svg"));
    }

    #[test]
    fn bars_one_rect_per_value() {
        let b = BarChart::new("mem", "bytes", &["ddp", "zero1"])
            .y_units(Units::DecimalBytes)
            .series("params", vec![67.9e6, 33.9e6])
            .series("AdamW state", vec![135.8e6, 67.9e6])
            .svg();
        dump("bars", &b);
        let labels: Vec<String> = texts(&b).into_iter().map(|x| x.1).collect();
        assert!(labels.iter().any(|l| l == "ddp") && labels.iter().any(|l| l == "zero1"), "{labels:?}");
        assert!(labels.iter().any(|l| l.ends_with(" MB")), "y ticks in MB: {labels:?}");
        assert!(b.matches("<rect").count() >= 1 + 4 + 2, "background, four bars, two legend swatches");
    }
}
