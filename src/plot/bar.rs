//! The grouped bar chart: one group per label along x, one bar per series in each group.

use super::{axis, draw_legend, range, render, show_svg, Units, FONT, LEGEND_W, PALETTE, W};
use plotters::coord::Shift;
use plotters::prelude::*;

/// A grouped bar chart: `groups` along x, one bar per series in each group.
#[derive(Clone, Debug, Default)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    pub groups: Vec<String>,
    pub y_units: Units,
    pub series: Vec<(String, Vec<f64>)>,
}

impl BarChart {
    pub fn new(title: &str, y_label: &str, groups: &[&str]) -> Self {
        BarChart {
            title: title.into(),
            y_label: y_label.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            ..Default::default()
        }
    }
    /// How the y ticks are written (e.g. [`Units::DecimalBytes`] for byte counts).
    pub fn y_units(mut self, u: Units) -> Self {
        self.y_units = u;
        self
    }
    pub fn series(mut self, name: &str, values: Vec<f64>) -> Self {
        self.series.push((name.into(), values));
        self
    }

    /// The chart as an SVG document.
    pub fn svg(&self) -> String {
        render(|root| self.draw(root))
    }

    fn draw(&self, root: &DrawingArea<SVGBackend, Shift>) -> Result<(), Box<dyn std::error::Error>> {
        root.fill(&WHITE)?;
        let (plot, legend_area) = root.split_horizontally(W - LEGEND_W);
        let vals: Vec<f64> = self.series.iter().flat_map(|s| s.1.iter().copied()).filter(|v| v.is_finite()).collect();
        let (y0, y1) = range(&vals, false, true);
        let ng = self.groups.len().max(1);
        let groups = self.groups.clone();
        let mut chart = ChartBuilder::on(&plot)
            .caption(&self.title, (FONT, 17))
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..ng as f64, axis(y0, y1, true, false, self.y_units))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(ng * 2 + 1)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                if (x - i as f64 - 0.5).abs() < 1e-6 {
                    groups.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc(self.y_label.as_str())
            .axis_desc_style((FONT, 14))
            .label_style((FONT, 12))
            .light_line_style(RGBColor(235, 235, 235))
            .bold_line_style(RGBColor(215, 215, 215))
            .y_labels(7)
            .draw()?;
        let ns = self.series.len().max(1) as f64;
        let width = 0.8 / ns;
        for (si, (_, values)) in self.series.iter().enumerate() {
            let c = PALETTE[si % PALETTE.len()];
            chart.draw_series(values.iter().take(ng).enumerate().filter(|(_, v)| v.is_finite()).map(|(g, &v)| {
                let x = g as f64 + 0.1 + si as f64 * width;
                Rectangle::new([(x, 0.0), (x + width * 0.92, v)], c.filled())
            }))?;
        }
        draw_legend(&legend_area, self.series.iter().map(|s| s.0.as_str()), true)?;
        Ok(())
    }

    /// Display inline in an evcxr notebook.
    pub fn show(&self) {
        show_svg(&self.svg());
    }
}
