// keelctl's views of keeld's straggler report (StragglerMonitor::report(),
// docs/architecture.md "Health": stragglers): the per-rank table of
// `keelctl stragglers` and the heat map of `keelctl stragglers --plot`.
// A report that is not of that shape is Error(kInternal) (keeld and keelctl
// disagree, a bug); a picture that cannot be written is Error(kBadConfig)
// naming the file (the operator named it).
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <ostream>

namespace keel::daemon {

// rank, median compute ms and score of the newest window, flagged; then the
// synchronisation tax.
void print_stragglers(const nlohmann::json& report, std::ostream& out);

// A kStragglerPlotWidth x kStragglerPlotHeight PNG: compute time per rank
// (rows, rank 0 on top) and step (columns, ascending) from dark blue (the
// fastest) to yellow (the slowest) with its scale bar, grey where a rank's
// step was not seen, flagged ranks outlined in red. More steps or ranks
// than the heat map has pixels share one: steps by their mean, ranks by
// their maximum, so a straggler among thousands still shows. Written
// atomically.
void plot_stragglers(const nlohmann::json& report, const std::filesystem::path& png);

// The picture's layout: the heat map fills [left, right) x [top, bottom).
inline constexpr int kStragglerPlotWidth = 1000;
inline constexpr int kStragglerPlotHeight = 560;
inline constexpr int kStragglerMapLeft = 80, kStragglerMapRight = 860;
inline constexpr int kStragglerMapTop = 56, kStragglerMapBottom = 490;

}  // namespace keel::daemon
