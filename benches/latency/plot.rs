//! The SVGs: log-log charts of named series, one line each. The latency sweep draws median
//! latency against size, one line per mode; the throughput sweep calls/s against calls in
//! flight.

use plotters::prelude::*;

use crate::stats::Row;

/// Median latency against size, one line per mode.
pub fn draw(path: &str, rows: &[Row], title: &str) -> Result<(), Box<dyn std::error::Error>> {
    let mut modes: Vec<&str> = rows.iter().map(|r| r.mode.as_str()).collect();
    modes.dedup();
    let series = modes
        .iter()
        .map(|mode| {
            let pts = rows
                .iter()
                .filter(|r| r.mode == *mode)
                .map(|r| ((r.bytes.max(1)) as f64, r.t_typical))
                .collect();
            ((*mode).to_owned(), pts)
        })
        .collect();
    lines(
        path,
        title,
        (
            "message size [bytes]",
            "t_typical (median) [usec]; RTT/2 for send/write, RTT otherwise",
        ),
        series,
    )
}

/// A log-log chart of `series` (a label and its points each), axes described by `axes`.
pub fn lines(
    path: &str,
    title: &str,
    axes: (&str, &str),
    series: Vec<(String, Vec<(f64, f64)>)>,
) -> Result<(), Box<dyn std::error::Error>> {
    let all = || series.iter().flat_map(|(_, pts)| pts.iter().copied());
    let (xmin, xmax) = all().fold((f64::MAX, 1.0f64), |(a, b), (x, _)| (a.min(x), b.max(x)));
    let (ymin, ymax) = all().fold((f64::MAX, 0.0f64), |(a, b), (_, y)| (a.min(y), b.max(y)));
    let root = SVGBackend::new(path, (1100, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d(
            (xmin.max(1.0)..xmax * 1.5).log_scale(),
            (ymin.max(0.01) * 0.7..ymax * 1.5).log_scale(),
        )?;
    chart.configure_mesh().x_desc(axes.0).y_desc(axes.1).draw()?;
    for (i, (label, pts)) in series.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(label)
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
