-- contains_prefix.lua: how much of a key sequence is cached.
--
-- KEYS[1]  the cell's key prefix (P); every key a script touches starts with it
-- ARGV     keys
-- Returns  how many leading keys are present

for i, key in ipairs(ARGV) do
  if not lookup_copy(key) then return i - 1 end
end
return #ARGV
