// Which cell of a deployment an object lives in (pure: no I/O).
//
// A key routes by its route: the text between its first '{' and the next '}' when that is
// not empty (as a Redis hash tag), else the whole key; a replica's copy key routes as its
// object's. Prefix-chunk keys carry their chain's
// root as that tag (kvcache's prefix_chunk_keys), so a request's chain lives in one cell and
// contains_prefix stays one round trip.
//
// The cell is chosen by rendezvous (highest random weight) hashing: every cell scores
// score(cell, route) = mix64(fnv1a64(cell '\0' route)) and the highest wins. Adding a cell
// moves only the keys the new cell wins, removing one only its own keys: a change of the set
// moves no bytes, and until it settles a get looks first where the previous set put the key.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace kvstash::metadata {

std::string_view route_of(std::string_view key);

// The score of `cell` for `route` (documented above, for other clients to agree on).
std::uint64_t rendezvous_score(std::string_view cell, std::string_view route);

// The index of the cell with the highest score for `route`; cells.size() when there is none.
std::size_t pick_cell(std::span<const std::string> cells, std::string_view route);

}  // namespace kvstash::metadata
