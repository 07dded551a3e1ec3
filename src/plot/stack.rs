//! Several charts from one notebook cell. evcxr keeps one image per cell (a second `show` in the
//! cell replaces the first), so a cell that draws two charts stacks them into one SVG.

use super::{show_svg, H, W};

/// Shows several charts from one notebook cell, one under the other, as one image (see
/// [`show_svg`] for why one image).
pub fn show_all(svgs: &[String]) {
    show_svg(&stack(svgs));
}

/// Stacks SVG documents vertically into one: each becomes a nested `<svg>` placed at its offset.
/// The result is as wide as the widest and as high as all of them together.
pub fn stack(svgs: &[String]) -> String {
    let mut body = String::new();
    let (mut width, mut height) = (0.0f64, 0.0f64);
    for svg in svgs {
        let svg = svg.trim();
        let Some(start) = svg.find("<svg") else { continue };
        let svg = &svg[start..];
        let tag_end = svg.find('>').unwrap_or(svg.len());
        let tag = &svg[..tag_end];
        let w = attribute(tag, "width").unwrap_or(W as f64);
        let h = attribute(tag, "height").unwrap_or(H as f64);
        body.push_str(&format!("<svg x=\"0\" y=\"{height}\"{}\n", &svg[4..]));
        width = width.max(w);
        height += h;
    }
    format!(
        r#"<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">
{body}</svg>
"#
    )
}

/// The numeric value of `name="…"` in an element's opening tag.
fn attribute(tag: &str, name: &str) -> Option<f64> {
    let at = tag.find(&format!(" {name}=\""))? + name.len() + 3;
    tag[at..].split('"').next()?.trim_end_matches("px").parse().ok()
}

#[cfg(test)]
mod tests {
    use super::super::{timeline_svg, BarChart, LineChart};
    use super::*;

    #[test]
    fn stacked_charts_keep_every_chart_one_under_the_other() {
        let a = LineChart::new("first chart", "x", "y").series("a", vec![(1.0, 1.0), (2.0, 2.0)]).svg();
        let b = BarChart::new("second chart", "y", &["g"]).series("s", vec![1.0]).svg();
        let t = timeline_svg("third chart", &[vec![(0.0, 1.0, 0, true)]]);
        let s = stack(&[a.clone(), b.clone(), t.clone()]);
        let heights: Vec<f64> =
            [&a, &b, &t].iter().map(|x| attribute(&x[..x.find('>').unwrap()], "height").unwrap()).collect();
        let total: f64 = heights.iter().sum();
        let width =
            [&a, &b, &t].iter().map(|x| attribute(&x[..x.find('>').unwrap()], "width").unwrap()).fold(0.0, f64::max);
        assert!(s.starts_with(&format!(r#"<svg width="{width}" height="{total}""#)), "{}", &s[..120]);
        for title in ["first chart", "second chart", "third chart"] {
            assert_eq!(s.matches(title).count(), 1, "{title} once");
        }
        // Each chart sits below the ones before it.
        let offsets: Vec<f64> = s
            .match_indices("<svg x=\"0\" y=\"")
            .map(|(i, m)| s[i + m.len()..].split('"').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(offsets, vec![0.0, heights[0], heights[0] + heights[1]]);
        assert_eq!(s.matches("<svg").count(), 4);
        assert_eq!(s.matches("</svg>").count(), 4);
    }
}
