//! The line chart: named series of (x, y) points, with an optional log₂ x axis (message-size
//! sweeps, ticks in binary units) and log₁₀ y axis.

use super::{axis, draw_legend, range, render, show_svg, Units, FONT, LEGEND_W, PALETTE, W};
use plotters::coord::Shift;
use plotters::prelude::*;

/// A line chart: several named series of (x, y) points.
#[derive(Clone, Debug, Default)]
pub struct LineChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    /// x on a log₂ axis (sizes that double), ticks at powers of two.
    pub log2_x: bool,
    /// y on a log₁₀ axis (bandwidths, times spanning decades).
    pub log_y: bool,
    pub x_units: Units,
    pub y_units: Units,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

impl LineChart {
    pub fn new(title: &str, x_label: &str, y_label: &str) -> Self {
        LineChart { title: title.into(), x_label: x_label.into(), y_label: y_label.into(), ..Default::default() }
    }
    /// A log₂ x axis for sizes that double; tick labels in binary units (4 KiB … 64 MiB).
    pub fn log2_x(mut self) -> Self {
        self.log2_x = true;
        self.x_units = Units::Bytes;
        self
    }
    /// A log₁₀ y axis.
    pub fn log_y(mut self) -> Self {
        self.log_y = true;
        self
    }
    /// How the y ticks are written (e.g. [`Units::DecimalBytes`] for byte counts).
    pub fn y_units(mut self, u: Units) -> Self {
        self.y_units = u;
        self
    }
    pub fn series(mut self, name: &str, points: Vec<(f64, f64)>) -> Self {
        self.series.push((name.into(), points));
        self
    }

    /// The chart as an SVG document.
    pub fn svg(&self) -> String {
        render(|root| self.draw(root))
    }

    fn draw(&self, root: &DrawingArea<SVGBackend, Shift>) -> Result<(), Box<dyn std::error::Error>> {
        root.fill(&WHITE)?;
        let (plot, legend_area) = root.split_horizontally(W - LEGEND_W);
        let pts = || self.series.iter().flat_map(|s| s.1.iter().copied());
        let finite = |v: f64, log: bool| v.is_finite() && (!log || v > 0.0);
        let xs: Vec<f64> = pts().map(|p| p.0).filter(|&x| finite(x, self.log2_x)).collect();
        let ys: Vec<f64> = pts().map(|p| p.1).filter(|&y| finite(y, self.log_y)).collect();
        let (x0, x1) = range(&xs, self.log2_x, false);
        let (y0, y1) = range(&ys, self.log_y, !self.log_y);
        let (xs_lin, ys_lin) = (!self.log2_x, !self.log_y);
        let mut chart = ChartBuilder::on(&plot)
            .caption(&self.title, (FONT, 17))
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(64)
            .build_cartesian_2d(
                axis(x0, x1, xs_lin, self.log2_x, self.x_units),
                axis(y0, y1, ys_lin, false, self.y_units),
            )?;
        chart
            .configure_mesh()
            .x_desc(self.x_label.as_str())
            .y_desc(self.y_label.as_str())
            .axis_desc_style((FONT, 14))
            .label_style((FONT, 12))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(215, 215, 215))
            .x_labels(10)
            .y_labels(7)
            .draw()?;
        for (i, (_, points)) in self.series.iter().enumerate() {
            let c = PALETTE[i % PALETTE.len()];
            let pts: Vec<(f64, f64)> =
                points.iter().copied().filter(|&(x, y)| finite(x, self.log2_x) && finite(y, self.log_y)).collect();
            chart.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?;
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
        }
        draw_legend(&legend_area, self.series.iter().map(|s| s.0.as_str()), false)?;
        Ok(())
    }

    /// Display inline in an evcxr notebook.
    pub fn show(&self) {
        show_svg(&self.svg());
    }
}
