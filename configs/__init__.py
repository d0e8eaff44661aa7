"""The shipped experiment configs (package data of `mmgrpo.configs`): ``mmgrpo train t2i_shapes`` finds
``tiny/t2i_shapes.yaml`` here when no such file exists in the working directory."""
