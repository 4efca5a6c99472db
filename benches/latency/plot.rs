//! The SVG: median latency against size, log-log, one line per mode.

use plotters::prelude::*;

use crate::stats::Row;

pub fn draw(path: &str, rows: &[Row], title: &str) -> Result<(), Box<dyn std::error::Error>> {
    let mut modes: Vec<&str> = rows.iter().map(|r| r.mode.as_str()).collect();
    modes.dedup();
    let (xmin, xmax) = rows.iter().fold((f64::MAX, 1.0f64), |(a, b), r| {
        let x = (r.bytes.max(1)) as f64;
        (a.min(x), b.max(x))
    });
    let (ymin, ymax) = rows
        .iter()
        .fold((f64::MAX, 0.0f64), |(a, b), r| (a.min(r.t_typical), b.max(r.t_typical)));
    let root = SVGBackend::new(path, (1100, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (xmin.max(1.0)..xmax * 1.5).log_scale(),
            (ymin.max(0.01) * 0.7..ymax * 1.5).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("message size [bytes]")
        .y_desc("t_typical (median) [usec]; RTT/2 for send/write, RTT otherwise")
        .draw()?;
    for (i, mode) in modes.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.mode == *mode)
            .map(|r| ((r.bytes.max(1)) as f64, r.t_typical))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(*mode)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
