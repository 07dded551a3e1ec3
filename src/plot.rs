//! Small SVG charts for notebooks and reports, with no dependencies: line charts (optionally with a
//! log2 x axis, e.g. message size) and bar charts. In an evcxr notebook, `chart.show()` displays
//! the SVG inline (evcxr's `EVCXR_BEGIN_CONTENT image/svg+xml` protocol).

use std::fmt::Write;

const W: f64 = 640.0;
const H: f64 = 360.0;
const L: f64 = 70.0; // left margin
const R: f64 = 150.0; // right margin (legend)
const T: f64 = 40.0;
const B: f64 = 50.0;
const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];

/// A line chart: several named series of (x, y) points.
#[derive(Clone, Debug, Default)]
pub struct LineChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log2_x: bool,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

impl LineChart {
    pub fn new(title: &str, x_label: &str, y_label: &str) -> Self {
        LineChart { title: title.into(), x_label: x_label.into(), y_label: y_label.into(), ..Default::default() }
    }
    /// Use a log2 x axis (for sizes that double).
    pub fn log2_x(mut self) -> Self {
        self.log2_x = true;
        self
    }
    pub fn series(mut self, name: &str, points: Vec<(f64, f64)>) -> Self {
        self.series.push((name.into(), points));
        self
    }

    /// The chart as an SVG document.
    pub fn svg(&self) -> String {
        let fx = |x: f64| if self.log2_x { x.max(f64::MIN_POSITIVE).log2() } else { x };
        let pts: Vec<(f64, f64)> = self.series.iter().flat_map(|s| s.1.iter().map(|&(x, y)| (fx(x), y))).collect();
        let (x0, x1) = bounds(pts.iter().map(|p| p.0));
        let (_, y1) = bounds(pts.iter().map(|p| p.1));
        let (y0, y1) = (0.0f64.min(bounds(pts.iter().map(|p| p.1)).0), y1 * 1.05);
        let sx = |x: f64| L + (fx(x) - x0) / (x1 - x0).max(1e-12) * (W - L - R);
        let sy = |y: f64| H - B - (y - y0) / (y1 - y0).max(1e-12) * (H - T - B);
        let mut s = header(&self.title, &self.x_label, &self.y_label);
        y_grid(&mut s, y0, y1, sy);
        // x ticks at the data's x values (first series)
        if let Some((_, first)) = self.series.first() {
            for &(x, _) in first {
                let label = if self.log2_x { crate::bench::fmt_size(x as u64) } else { num(x) };
                let _ = write!(
                    s,
                    r##"<text x="{:.1}" y="{}" text-anchor="middle" font-size="11">{label}</text>"##,
                    sx(x),
                    H - B + 16.0
                );
            }
        }
        for (i, (name, p)) in self.series.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            let path: Vec<String> = p.iter().map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y))).collect();
            let _ = write!(s, r##"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"##, path.join(" "));
            for &(x, y) in p {
                let _ = write!(s, r##"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"##, sx(x), sy(y));
            }
            legend(&mut s, i, name, c);
        }
        s.push_str("</svg>");
        s
    }

    /// Display inline in an evcxr notebook (prints the SVG with evcxr's content markers).
    pub fn show(&self) {
        show_svg(&self.svg());
    }
}

/// A bar chart: groups (x labels) × series (colours).
#[derive(Clone, Debug, Default)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    pub groups: Vec<String>,
    pub series: Vec<(String, Vec<f64>)>,
}

impl BarChart {
    pub fn new(title: &str, y_label: &str, groups: &[&str]) -> Self {
        BarChart {
            title: title.into(),
            y_label: y_label.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            series: Vec::new(),
        }
    }
    pub fn series(mut self, name: &str, values: Vec<f64>) -> Self {
        self.series.push((name.into(), values));
        self
    }
    pub fn svg(&self) -> String {
        let y1 = self.series.iter().flat_map(|s| s.1.iter().copied()).fold(0.0f64, f64::max) * 1.1;
        let y1 = if y1 > 0.0 { y1 } else { 1.0 };
        let sy = |y: f64| H - B - y / y1 * (H - T - B);
        let mut s = header(&self.title, "", &self.y_label);
        y_grid(&mut s, 0.0, y1, sy);
        let gw = (W - L - R) / self.groups.len().max(1) as f64;
        let bw = gw * 0.8 / self.series.len().max(1) as f64;
        for (g, label) in self.groups.iter().enumerate() {
            let gx = L + g as f64 * gw + gw * 0.1;
            let _ = write!(
                s,
                r##"<text x="{:.1}" y="{}" text-anchor="middle" font-size="11">{label}</text>"##,
                gx + gw * 0.4,
                H - B + 16.0
            );
            for (i, (_, v)) in self.series.iter().enumerate() {
                let y = v.get(g).copied().unwrap_or(0.0);
                let _ = write!(
                    s,
                    r##"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"##,
                    gx + i as f64 * bw,
                    sy(y),
                    bw * 0.95,
                    (H - B - sy(y)).max(0.0),
                    COLORS[i % COLORS.len()]
                );
            }
        }
        for (i, (name, _)) in self.series.iter().enumerate() {
            legend(&mut s, i, name, COLORS[i % COLORS.len()]);
        }
        s.push_str("</svg>");
        s
    }
    pub fn show(&self) {
        show_svg(&self.svg());
    }
}

/// Five horizontal grid lines with their values, from y0 to y1.
fn y_grid(s: &mut String, y0: f64, y1: f64, sy: impl Fn(f64) -> f64) {
    for i in 0..=4 {
        let y = y0 + (y1 - y0) * i as f64 / 4.0;
        let _ = write!(
            s,
            r##"<line x1="{L}" x2="{0}" y1="{1:.1}" y2="{1:.1}" stroke="#ddd"/><text x="{2}" y="{3:.1}" text-anchor="end" font-size="11">{4}</text>"##,
            W - R,
            sy(y),
            L - 6.0,
            sy(y) + 4.0,
            num(y)
        );
    }
}

fn bounds(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = v.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    if lo.is_finite() {
        (lo, if hi > lo { hi } else { lo + 1.0 })
    } else {
        (0.0, 1.0)
    }
}

fn num(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn header(title: &str, x_label: &str, y_label: &str) -> String {
    format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15">{}</text><text x="{}" y="{}" text-anchor="middle" font-size="12">{}</text><text transform="translate(16,{}) rotate(-90)" text-anchor="middle" font-size="12">{}</text><line x1="{L}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{L}" y1="{T}" x2="{L}" y2="{}" stroke="black"/>"##,
        (W - R + L) / 2.0,
        esc(title),
        (W - R + L) / 2.0,
        H - 12.0,
        esc(x_label),
        (H - B + T) / 2.0,
        esc(y_label),
        H - B,
        W - R,
        H - B,
        H - B
    )
}

fn legend(s: &mut String, i: usize, name: &str, color: &str) {
    let y = T + 10.0 + i as f64 * 18.0;
    let _ = write!(
        s,
        r##"<rect x="{}" y="{}" width="12" height="12" fill="{color}"/><text x="{}" y="{}" font-size="12">{}</text>"##,
        W - R + 12.0,
        y - 10.0,
        W - R + 30.0,
        y,
        esc(name)
    );
}

/// Print an SVG so that evcxr shows it as an image.
pub fn show_svg(svg: &str) {
    println!("EVCXR_BEGIN_CONTENT image/svg+xml\n{svg}\nEVCXR_END_CONTENT");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_well_formed_svg() {
        let l =
            LineChart::new("bw", "size", "GB/s").log2_x().series("ring", vec![(4096.0, 0.1), (1048576.0, 2.0)]).svg();
        assert!(
            l.starts_with("<svg")
                && l.ends_with("</svg>")
                && l.contains("polyline")
                && l.contains("4K")
                && l.contains("1M")
        );
        let b = BarChart::new("mem", "GiB", &["ddp", "zero1"]).series("params", vec![1.0, 0.5]).svg();
        assert_eq!(b.matches("<rect").count(), 1 + 2 + 1, "background, two bars, one legend swatch");
    }
}
