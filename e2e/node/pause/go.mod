module pagekube.e2e/pause

go 1.25
