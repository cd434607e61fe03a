// A small line chart drawn by hand on a canvas: the last minutes of one figure.

/** The points kept: five minutes at one sample a second. */
export const HISTORY = 300;

/** Samples of one figure, oldest first, at most HISTORY of them. */
export class Series {
  constructor() {
    this.values = [];
  }

  push(value) {
    this.values.push(value);
    if (this.values.length > HISTORY) {
      this.values.shift();
    }
  }
}

function color(name, fallback) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || fallback;
}

/** Draw `series` on `canvas`: a filled line, scaled to its largest value (at least 1), right-aligned. */
export function draw(canvas, series) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  context.clearRect(0, 0, width, height);
  const values = series.values;
  const top = Math.max(1, ...values);
  const step = width / (HISTORY - 1);
  const x = (index) => width - (values.length - 1 - index) * step;
  const y = (value) => height - 2 - (value / top) * (height - 4);
  context.strokeStyle = color("--line", "#d9dcde");
  context.beginPath();
  context.moveTo(0, height - 1.5);
  context.lineTo(width, height - 1.5);
  context.stroke();
  if (values.length < 2) {
    return;
  }
  const accent = color("--accent", "#2b6cb0");
  context.beginPath();
  values.forEach((value, index) => (index ? context.lineTo(x(index), y(value)) : context.moveTo(x(index), y(value))));
  context.strokeStyle = accent;
  context.lineWidth = 1.5;
  context.stroke();
  context.lineTo(x(values.length - 1), height);
  context.lineTo(x(0), height);
  context.closePath();
  context.globalAlpha = 0.15;
  context.fillStyle = accent;
  context.fill();
  context.globalAlpha = 1;
  context.fillStyle = color("--muted", "#6b7075");
  context.font = "10px system-ui, sans-serif";
  context.fillText(`max ${Number.isInteger(top) ? top : top.toFixed(1)}`, 2, 10);
}
